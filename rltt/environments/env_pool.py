"""Where an environment's code runs: in worker processes (`EnvPool`, ``env.isolated: true``, the
default) or in the trainer's process (`InProcessEnv`).

The episode loop (`rltt.orchestration.episodes`) makes an environment's calls in batches — every
episode's `Environment.start`, then at each turn the `Environment.step` of every episode still
going, then (when the environment has its own) `Environment.answer` — through one of these two,
which answer each call with ``(value, None)`` or ``(None, error message)``. A failed call ends
its episode (scored 0, counted in ``env/errors``); the other calls of the batch are unaffected.

`EnvPool` runs the calls in ``workers`` processes of a `rltt.runtime.worker_pool.WorkerPool`
(started from a forkserver once per run, on first use): each call may take ``timeout_s`` seconds
and each worker ``memory_mb`` of address space (``RLIMIT_AS``: an allocation past it raises
`MemoryError` in the environment's code). A call that raises, hangs past its timeout or ends its
process (``os._exit``, SIGKILL, a segfault) fails alone; the pool replaces a dead or killed worker
and the rest of the batch goes on there.

**Episode state travels with the call.** The environment object is pickled once and copied to
every worker when it starts; an episode's state (what ``start`` returned) is sent with each
``step`` call and sent back with the reply — ``step`` may change it in place, as in-process — so
any worker can serve any call, and a worker's death loses only the call it was on, never the
state of other episodes. The state must pickle (a call whose state does not fails alone), and an
environment must keep per-episode state in it, not on ``self`` (each worker has its own copy).

Both runners give the same replies for the same calls, so the episodes — tokens, records,
rewards — are bitwise the same isolated or not (`tests/environments/test_env_pool.py`).
"""

from __future__ import annotations

import pickle
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

from rltt.environments.base import Environment, EnvReply
from rltt.errors import RlttError
from rltt.runtime.worker_pool import WorkerPool, default_workers, die_with_parent, ignore_stop_signals, serve

#: Least address space an environment worker may be given (the interpreter and rltt's tool layer).
MIN_ENV_MEMORY_MB = 256


def call_error(exc: BaseException) -> str:
    """An environment call's exception as the episode's one-line error message."""
    return f"{type(exc).__name__}: {' '.join(str(exc).splitlines())}"[:500]


def _start(env: Environment, task: Any):
    return env.start(task)


def _step(env: Environment, state: Any, turn: str):
    reply = env.step(state, turn)
    if not isinstance(reply, EnvReply):
        raise TypeError(f"{type(env).__name__}.step returned {type(reply).__name__}, not an EnvReply")
    return reply, state


def _answer(env: Environment, turns: list[str]):
    text = env.answer(turns)
    if not isinstance(text, str):
        raise TypeError(f"{type(env).__name__}.answer returned {type(text).__name__}, not a str")
    return text


#: The environment's calls the episode loop makes: name -> what runs (on the environment and the call's arguments)
CALLS: dict[str, Callable] = {"start": _start, "step": _step, "answer": _answer}


def run_call(env: Environment, payload: tuple, catch: type[BaseException] = Exception):
    """``(value, None)`` or ``(None, message)`` of the call ``payload`` = ``(name, *arguments)``."""
    try:
        return CALLS[payload[0]](env, *payload[1:]), None
    except catch as exc:  # noqa: BLE001 - the episode fails, the run goes on
        return None, call_error(exc)


def own_answer(env: Environment) -> bool:
    """Whether ``env`` overrides `Environment.answer` (the base class's runs where the loop is)."""
    return type(env).answer is not Environment.answer


class InProcessEnv:
    """The environment's calls in the trainer's process (``env.isolated: false``): an exception
    fails its episode; a hang, an exit or a crash is the run's."""

    def __init__(self, env: Environment):
        self.env = env

    def _calls(self, payloads: list[tuple]) -> list[tuple[Any, str | None]]:
        return [run_call(self.env, p) for p in payloads]

    def start(self, tasks: Sequence[Any]) -> list[tuple[Any, str | None]]:
        """Each task's ``(state, None)`` or ``(None, error)``."""
        return self._calls([("start", t) for t in tasks])

    def step(self, states: Sequence[Any], turns: Sequence[str]) -> list[tuple[Any, str | None]]:
        """Each ``((reply, state after the step), None)`` or ``(None, error)``."""
        return self._calls([("step", s, t) for s, t in zip(states, turns)])

    def answer(self, turns: Sequence[list[str]]) -> list[tuple[Any, str | None]]:
        """Each episode's ``(text the rewards score, None)`` or ``(None, error)``."""
        if not own_answer(self.env):
            return [(self.env.answer(t), None) for t in turns]
        return self._calls([("answer", list(t)) for t in turns])

    def close(self) -> None:
        pass


def _set_memory_limit(memory_mb: int) -> None:
    import resource

    limit = memory_mb << 20
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):  # a platform without this limit (macOS)
        if sys.platform.startswith("linux"):
            raise


def _env_worker_main(conn: Connection, env_bytes: bytes, memory_mb: int) -> None:
    die_with_parent()
    ignore_stop_signals()
    try:
        env = pickle.loads(env_bytes)
        _set_memory_limit(memory_mb)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("load_error", call_error(exc)))
        return
    conn.send(("ready", None))
    serve(conn, lambda payload: run_call(env, payload, BaseException))


class _EnvWorkers(WorkerPool):
    what = "environment"
    loading = "loading the environment"
    load_failed = "could not load the environment"

    def __init__(self, env_bytes: bytes, memory_mb: int, workers: int):
        super().__init__(workers)
        self.env_bytes, self.memory_mb = env_bytes, memory_mb

    def target(self):
        return _env_worker_main, (self.env_bytes, self.memory_mb)


class EnvPool(InProcessEnv):
    """The environment's calls in ``workers`` processes (``env.workers``; null: `default_workers`),
    ``timeout_s`` seconds per call (``env.timeout_s``), ``memory_mb`` of address space per worker
    (``env.memory_mb``). One pool serves a run (started on first use); `close` stops its workers."""

    def __init__(self, env: Environment, workers: int | None = None, timeout_s: float = 30.0,
                 memory_mb: int = 4096):
        super().__init__(env)
        try:
            env_bytes = pickle.dumps(env)
        except Exception as exc:  # noqa: BLE001 - before any episode runs
            raise RlttError(f"env: the {type(env).__name__} environment does not pickle, so it cannot run isolated "
                            f"({call_error(exc)}); make it picklable or set env.isolated: false") from None
        self.timeout_s = float(timeout_s)
        self.workers = _EnvWorkers(env_bytes, int(memory_mb), workers if workers is not None else default_workers())

    @property
    def restarts(self) -> int:
        """Workers replaced so far (a call that hung or ended its process)."""
        return self.workers.restarts

    def _calls(self, payloads: list[tuple]) -> list[tuple[Any, str | None]]:
        return self.workers.call(payloads, [self.timeout_s] * len(payloads))

    def close(self) -> None:
        """Stop the workers (a later call starts new ones)."""
        self.workers.close()
