"""Reward functions in worker processes: a hang, ``sys.exit`` or crash of reward code costs one sample.

`RewardPool` keeps ``workers`` processes (`rltt.runtime.worker_pool`: started from a
``forkserver``, so they do not inherit the trainer's threads, CUDA state or memory) that load the
reward functions from their spec strings. `RewardPool.run` sends each worker one contiguous chunk
of a step's tasks in one message; the worker scores them in order and sends back one small result
per task, so the parent knows which task each worker is on. A task that does not finish within
its timeout gets its worker killed; a worker that dies (``os._exit``, a segfault, the OOM killer)
is noticed from its closed pipe; either way that task fails, a fresh worker replaces the old one
and the rest of the chunk goes on there. ``SystemExit`` / ``KeyboardInterrupt`` raised by reward
code are caught in the worker like any exception.

A result is ``(score, None)`` or ``(None, message)``; :func:`as_score` decides what is a score.
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Sequence

from rltt.runtime.worker_pool import FORKSERVER_PRELOAD, START_TIMEOUT_S, WorkerPool, default_workers  # noqa: F401
from rltt.runtime.worker_pool import die_with_parent, ignore_stop_signals, serve


def as_score(value: Any) -> tuple[float | None, str | None]:
    """``(float, None)`` for a real number finite in float32, else ``(None, why)``.

    ``int``/``float``/``bool`` (0 or 1) and numpy scalars are numbers; a string such as
    ``"0.75"``, None, a tensor or a list is not (no coercion). The check is in float32, the
    dtype rewards are used in: ``1e39`` is finite in float64 but inf in float32.
    """
    if not isinstance(value, numbers.Real):
        shown = repr(value) if isinstance(value, str) and len(value) < 40 else type(value).__name__
        return None, f"returned {shown}, not a number"
    value = float(value)
    try:
        finite = math.isfinite(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:  # beyond float32's range
        finite = False
    if not finite:
        return None, f"returned {value!r}, not finite in float32"
    return value, None


def _worker_main(conn: Connection, specs: list[tuple[str, str | None]]) -> None:
    die_with_parent()
    ignore_stop_signals()
    from rltt.data.reward_fns import load_reward_fn

    try:
        fns = [load_reward_fn(spec, root) for spec, root in specs]
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("load_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    serve(conn, lambda task: as_score(fns[task[0]](task[1], task[2], **task[3])))


@dataclass
class Task:
    """One reward call: function ``fn_index`` of the pool's specs on one sample."""

    fn_index: int
    completion: str
    answer: Any
    kw: dict
    timeout_s: float


class RewardPool(WorkerPool):
    """``workers`` reward processes for the functions ``specs`` (``(spec, root)`` pairs)."""

    what = "reward"
    loading = "importing the reward files"
    load_failed = "could not load the reward functions"

    def __init__(self, specs: Sequence[tuple[str, str | None]], workers: int = 1):
        super().__init__(workers)
        self.specs = list(specs)

    def target(self):
        return _worker_main, (self.specs,)

    def run(self, tasks: Sequence[Task]) -> list[tuple[float | None, str | None]]:
        """Every task's ``(score, None)`` or ``(None, error message)``, in order."""
        return self.call([(t.fn_index, t.completion, t.answer, t.kw) for t in tasks], [t.timeout_s for t in tasks])
