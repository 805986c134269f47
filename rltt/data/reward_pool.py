"""Reward functions in worker processes: a hang, ``sys.exit`` or crash of reward code costs one sample.

`RewardPool` keeps ``workers`` processes (started from a ``forkserver``, so they do not inherit
the trainer's threads, CUDA state or memory) that load the reward functions from their spec
strings. `RewardPool.run` sends each worker one contiguous chunk of a step's tasks in one
message; the worker scores them in order and sends back one small result per task, so the
parent knows which task each worker is on. A task that does not finish within its timeout
gets its worker killed; a worker that dies (``os._exit``, a segfault, the OOM killer) is
noticed from its closed pipe; either way that task fails, a fresh worker replaces the old one
and the rest of the chunk goes on there. ``SystemExit`` / ``KeyboardInterrupt`` raised by reward
code are caught in the worker like any exception.

A result is ``(score, None)`` or ``(None, message)``; :func:`as_score` decides what is a score.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import numbers
import os
import signal
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from rltt.errors import RlttError

#: How long a fresh worker may take to import the reward files.
START_TIMEOUT_S = 120.0
#: imported by the forkserver before it forks a worker: it ignores SIGTERM (see the module)
FORKSERVER_PRELOAD = "rltt.data.forkserver_init"


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


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when its parent (the forkserver) goes away."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort (not Linux)
        pass


def _worker_main(conn: Connection, specs: list[tuple[str, str | None]]) -> None:
    _die_with_parent()
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C reaches the whole process group: the run
        signal.signal(signum, signal.SIG_IGN)       # stops (rltt.runtime.stop); its pool stops the workers
    from rltt.data.reward_fns import load_reward_fn

    try:
        fns = [load_reward_fn(spec, root) for spec, root in specs]
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("load_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            tasks = conn.recv()
        except (EOFError, OSError):
            return
        if tasks is None:
            return
        for task_id, fn_index, completion, answer, kw in tasks:
            try:
                score, error = as_score(fns[fn_index](completion, answer, **kw))
            except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too
                score, error = None, f"{type(exc).__name__}: {exc}"
            conn.send((task_id, score, error))


def _exit_text(code: int | None) -> str:
    if code is None:
        return "it did not answer"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class Task:
    """One reward call: function ``fn_index`` of the pool's specs on one sample."""

    fn_index: int
    completion: str
    answer: Any
    kw: dict
    timeout_s: float


@dataclass
class _Worker:
    process: Any
    conn: Connection
    pending: deque = field(default_factory=deque)  # task ids sent, in order
    deadline: float = math.inf


class RewardPool:
    """``workers`` reward processes for the functions ``specs`` (``(spec, root)`` pairs)."""

    def __init__(self, specs: Sequence[tuple[str, str | None]], workers: int = 1):
        self.specs = list(specs)
        self.size = max(1, int(workers))
        self._ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
        if self._ctx.get_start_method() == "forkserver":  # applies when the forkserver starts (once a process)
            self._ctx.set_forkserver_preload([FORKSERVER_PRELOAD])
        self._workers: list[_Worker] = []
        self.restarts = 0

    # -- processes -------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(target=_worker_main, args=(child, self.specs), daemon=True,
                                    name="rltt-reward-worker")
        process.start()
        child.close()
        return _Worker(process, parent)

    def _await_ready(self, workers: list[_Worker]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = {w.conn: w for w in workers}
        while waiting:
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._kill(*waiting.values())
                raise RlttError(f"reward worker did not start within {START_TIMEOUT_S:g} s (importing the reward files)")
            for conn in ready:
                worker = waiting.pop(conn)
                try:
                    kind, message = conn.recv()
                except (EOFError, OSError):
                    worker.process.join(1)
                    raise RlttError(f"reward worker died while importing the reward files "
                                    f"({_exit_text(worker.process.exitcode)})") from None
                if kind != "ready":
                    self._kill(worker)
                    raise RlttError(f"reward worker could not load the reward functions: {message}")

    def _start(self) -> None:
        while len(self._workers) < self.size:
            self._workers.append(self._spawn())
        self._await_ready(self._workers)

    def _replace(self, worker: _Worker) -> _Worker:
        self._kill(worker)
        self.restarts += 1
        fresh = self._spawn()
        self._await_ready([fresh])
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    @staticmethod
    def _kill(*workers: _Worker) -> None:
        for w in workers:
            if w.process.is_alive():
                w.process.kill()
            w.process.join(5)
            w.conn.close()

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.process.join(1)
        self._kill(*self._workers)
        self._workers = []

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # -- scoring ---------------------------------------------------------------------------
    def run(self, tasks: Sequence[Task]) -> list[tuple[float | None, str | None]]:
        """Every task's ``(score, None)`` or ``(None, error message)``, in order."""
        results: list[tuple[float | None, str | None] | None] = [None] * len(tasks)
        if not tasks:
            return []
        if not self._workers:
            self._start()
        chunk = -(-len(tasks) // len(self._workers))
        for i, worker in enumerate(self._workers):
            ids = list(range(i * chunk, min((i + 1) * chunk, len(tasks))))
            self._send(worker, ids, tasks)
        while True:
            busy = [w for w in self._workers if w.pending]
            if not busy:
                break
            now = time.monotonic()
            ready = wait([w.conn for w in busy], timeout=max(0.0, min(w.deadline for w in busy) - now))
            for worker in [w for w in busy if w.conn in ready]:
                try:
                    task_id, score, error = worker.conn.recv()
                except (EOFError, OSError):  # the worker died on its current task
                    worker.process.join(5)
                    self._fail_current(worker, tasks, results, f"the reward process died "
                                                              f"({_exit_text(worker.process.exitcode)}); replaced")
                    continue
                expected = worker.pending.popleft()
                assert task_id == expected, (task_id, expected)
                results[task_id] = (score, error)
                if worker.pending:
                    worker.deadline = time.monotonic() + tasks[worker.pending[0]].timeout_s
            now = time.monotonic()
            for worker in [w for w in self._workers if w.pending and w.deadline <= now and w.conn not in ready]:
                timeout = tasks[worker.pending[0]].timeout_s
                self._fail_current(worker, tasks, results, f"timed out after {timeout:g} s (the reward process "
                                                           f"was killed and replaced)")
        return results  # type: ignore[return-value]

    def _send(self, worker: _Worker, ids: list[int], tasks: Sequence[Task]) -> None:
        worker.pending = deque(ids)
        if not ids:
            return
        worker.conn.send([(i, tasks[i].fn_index, tasks[i].completion, tasks[i].answer, tasks[i].kw) for i in ids])
        worker.deadline = time.monotonic() + tasks[ids[0]].timeout_s

    def _fail_current(self, worker: _Worker, tasks, results, message: str) -> None:
        """The worker's current task fails with ``message``; a fresh worker takes the rest."""
        current = worker.pending.popleft()
        results[current] = (None, message)
        rest = list(worker.pending)
        fresh = self._replace(worker)
        self._send(fresh, rest, tasks)


def default_workers() -> int:
    return max(1, min(4, (os.cpu_count() or 1) // 2))
