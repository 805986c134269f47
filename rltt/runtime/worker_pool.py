"""Calls in worker processes: a hang, an exit or a crash of the called code costs one call, not the run.

`WorkerPool` keeps ``size`` processes started from a ``forkserver`` (so they do not inherit the
trainer's threads, CUDA state or memory). A subclass says what a worker runs
(`WorkerPool.target`: a function and its arguments; the function prepares the worker, answers
``("ready", None)`` or ``("load_error", message)`` and then serves calls with `serve`).

`WorkerPool.call` sends each worker one contiguous chunk of the calls in one message; the worker
answers them in order, one small message per call, so the parent knows which call each worker
is on. A call that does not finish within its timeout gets its worker killed; a worker that dies
(``os._exit``, SIGKILL, a segfault, the OOM killer) is noticed from its closed pipe; either way
that call fails, a fresh worker replaces the old one and the rest of the chunk goes on there.

Two pools run on it: the reward functions' (`rltt.data.reward_pool`) and the environments'
(`rltt.environments.env_pool`). A result is ``(value, None)`` or ``(None, message)``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

from rltt.errors import RlttError

#: How long a fresh worker may take to get ready (import the code it runs).
START_TIMEOUT_S = 120.0
#: imported by the forkserver before it forks a worker: it ignores SIGTERM (see that module)
FORKSERVER_PRELOAD = "rltt.data.forkserver_init"

Result = tuple[Any, "str | None"]


def default_workers() -> int:
    """Workers of a pool when the recipe does not say: half the CPUs, between 1 and 4."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def die_with_parent() -> None:
    """Linux: the kernel kills this worker when its parent (the forkserver) goes away."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort (not Linux)
        pass


def ignore_stop_signals() -> None:
    """Ctrl-C reaches the whole process group: the run stops (`rltt.runtime.stop`) and its pools stop
    their workers, so a worker ignores SIGINT and SIGTERM itself."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


def serve(conn: Connection, handle: Callable[[Any], Result]) -> None:
    """A worker's loop: receive a chunk ``[(call id, payload), ...]``, answer each call with
    ``(call id, value, error)`` in order; ``None`` or a closed pipe ends it. ``handle`` returns
    ``(value, error)``; anything it raises (``SystemExit`` and ``KeyboardInterrupt`` too) fails
    that call, as does a value that cannot be sent back (it does not pickle)."""
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for call_id, payload in chunk:
            try:
                value, error = handle(payload)
            except BaseException as exc:  # noqa: BLE001 - the call fails, the worker goes on
                value, error = None, f"{type(exc).__name__}: {exc}"
            try:
                conn.send((call_id, value, error))  # pickled whole before anything is written
            except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
                conn.send((call_id, None, f"its result could not be sent back ({type(exc).__name__}: {exc})"))


def exit_text(code: int | None) -> str:
    if code is None:
        return "it did not answer"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class _Worker:
    process: Any
    conn: Connection
    pending: deque = field(default_factory=deque)  # call ids sent, in order
    deadline: float = math.inf


class WorkerPool:
    """``workers`` processes running `target`; `call` runs payloads on them with per-call timeouts.

    ``what`` names the pool in messages (``the reward process died``); ``loading`` says what a
    worker does before it is ready, ``load_failed`` what a ``load_error`` means."""

    what = "worker"
    loading = "starting"
    load_failed = "could not start"

    def __init__(self, workers: int = 1):
        self.size = max(1, int(workers))
        self._ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
        if self._ctx.get_start_method() == "forkserver":  # applies when the forkserver starts (once a process)
            self._ctx.set_forkserver_preload([FORKSERVER_PRELOAD])
        self._workers: list[_Worker] = []
        self.restarts = 0

    def target(self) -> tuple[Callable, tuple]:
        """The worker's function and its arguments (``conn`` is passed first)."""
        raise NotImplementedError

    # -- processes -------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        fn, args = self.target()
        process = self._ctx.Process(target=fn, args=(child, *args), daemon=True, name=f"rltt-{self.what}-worker")
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
                raise RlttError(f"{self.what} worker did not start within {START_TIMEOUT_S:g} s ({self.loading})")
            for conn in ready:
                worker = waiting.pop(conn)
                try:
                    kind, message = conn.recv()
                except (EOFError, OSError):
                    worker.process.join(1)
                    raise RlttError(f"{self.what} worker died while {self.loading} "
                                    f"({exit_text(worker.process.exitcode)})") from None
                if kind != "ready":
                    self._kill(worker)
                    raise RlttError(f"{self.what} worker {self.load_failed}: {message}")

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
        """Stop the workers (idempotent; a later `call` starts new ones)."""
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

    # -- calls -----------------------------------------------------------------------------
    def call(self, payloads: Sequence[Any], timeouts: Sequence[float]) -> list[Result]:
        """Every payload's ``(value, None)`` or ``(None, error message)``, in order; payload i
        may take ``timeouts[i]`` seconds."""
        results: list[Result | None] = [None] * len(payloads)
        if not payloads:
            return []
        if not self._workers:
            self._start()
        chunk = -(-len(payloads) // len(self._workers))
        for i, worker in enumerate(self._workers):
            self._send(worker, list(range(i * chunk, min((i + 1) * chunk, len(payloads)))), payloads, timeouts,
                       results)
        while True:
            busy = [w for w in self._workers if w.pending]
            if not busy:
                break
            now = time.monotonic()
            ready = wait([w.conn for w in busy], timeout=max(0.0, min(w.deadline for w in busy) - now))
            for worker in [w for w in busy if w.conn in ready]:
                try:
                    call_id, value, error = worker.conn.recv()
                except (EOFError, OSError):  # the worker died on its current call
                    worker.process.join(5)
                    self._fail_current(worker, payloads, timeouts, results,
                                       f"the {self.what} process died ({exit_text(worker.process.exitcode)}); replaced")
                    continue
                expected = worker.pending.popleft()
                assert call_id == expected, (call_id, expected)
                results[call_id] = (value, error)
                if worker.pending:
                    worker.deadline = time.monotonic() + timeouts[worker.pending[0]]
            now = time.monotonic()
            for worker in [w for w in self._workers if w.pending and w.deadline <= now and w.conn not in ready]:
                timeout = timeouts[worker.pending[0]]
                self._fail_current(worker, payloads, timeouts, results, f"timed out after {timeout:g} s (the "
                                                                        f"{self.what} process was killed and replaced)")
        return results  # type: ignore[return-value]

    def _send(self, worker: _Worker, ids: list[int], payloads, timeouts, results) -> None:
        """Send the calls ``ids`` to ``worker``; a payload that does not pickle fails alone."""
        try:
            worker.conn.send([(i, payloads[i]) for i in ids])  # pickled whole before anything is written
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            bad = []
            for i in ids:
                try:
                    pickle.dumps(payloads[i])
                except Exception:  # noqa: BLE001 - this call's payload is what fails
                    bad.append(i)
            if not bad:
                raise
            for i in bad:
                results[i] = (None, f"its input could not be sent to the {self.what} process "
                                    f"({type(exc).__name__}: {exc})")
            ids = [i for i in ids if i not in bad]
            worker.conn.send([(i, payloads[i]) for i in ids])
        worker.pending = deque(ids)
        if ids:
            worker.deadline = time.monotonic() + timeouts[ids[0]]

    def _fail_current(self, worker: _Worker, payloads, timeouts, results, message: str) -> None:
        """The worker's current call fails with ``message``; a fresh worker takes the rest."""
        current = worker.pending.popleft()
        results[current] = (None, message)
        rest = list(worker.pending)
        fresh = self._replace(worker)
        self._send(fresh, rest, payloads, timeouts, results)
