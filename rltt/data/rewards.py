"""The reward runner: scores completions with weighted reward functions (loaded from spec
strings by `rltt.data.reward_fns`).

``RewardRunner`` applies several weighted functions to a batch. A function that raises,
hangs past its timeout, exits or crashes its process, or returns something that is not a real
number finite in float32 (a string such as ``"0.75"`` is not coerced) scores 0 for that sample;
the failure is recorded as a ``RewardError`` (step, prompt id, function name, message), counted
per function, written (first occurrences, then rate-limited) to ``RUN_DIR/reward_errors.jsonl``
by a `RewardErrorLog`, and scoring goes on.

Isolation: reward functions loaded from a spec run in worker processes
(`rltt.data.reward_pool`) with a per-call timeout (``timeout_s``, recipe key
``rewards.N.timeout_s``), one message per worker per batch. The built-in rewards shipped with
rltt that are marked with :func:`builtin_reward` (plain string parsing, cannot hang) run
in-process, as do functions passed as Python callables without a spec.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from rltt.data.reward_fns import (RewardFn, builtin_reward, is_builtin, load_reward_fn,  # noqa: F401 - re-exported
                                  reward_name)
from rltt.errors import RlttError

#: Seconds one reward call may take before its worker is killed (recipe ``rewards.N.timeout_s``).
DEFAULT_TIMEOUT_S = 5.0
REWARD_ERRORS_FILE = "reward_errors.jsonl"


@dataclass
class WeightedReward:
    """A reward function, its weight in the total, and its name in logs.

    ``spec``/``root``: where it was loaded from (a worker process loads it the same way);
    ``isolated``: run it in a worker with ``timeout_s`` per call (default: when it has a spec
    and is not a :func:`builtin_reward`)."""

    name: str
    fn: RewardFn
    weight: float = 1.0
    spec: str | None = None
    root: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    isolated: bool | None = None

    def __post_init__(self) -> None:
        if self.isolated is None:
            self.isolated = self.spec is not None and not is_builtin(self.fn)
        if self.isolated and self.spec is None:
            raise RlttError(f"reward {self.name}: an isolated reward needs the spec it was loaded from")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise RlttError(f"reward {self.name}: timeout_s must be a positive number of seconds, got {self.timeout_s!r}")


@dataclass
class RewardSample:
    """One completion to score, with its reference answer and prompt id."""

    completion: str
    answer: str
    prompt_id: Any = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # passed to the functions as **kw


@dataclass
class RewardError:
    """A reward function that failed on one sample (scored 0)."""

    prompt_id: Any
    function: str
    message: str
    step: int | None = None

    def __str__(self) -> str:
        return f"reward {self.function} failed on prompt {self.prompt_id}: {self.message}"

    @property
    def kind(self) -> str:
        """What went wrong, without the details (the key of the log's rate limit)."""
        return self.message.split(":", 1)[0].split(" (", 1)[0][:60]


@dataclass
class RewardResult:
    """Scores for a batch: per function (name -> one score a sample), weighted totals, errors."""

    scores: dict[str, list[float]]
    total: list[float]
    errors: list[RewardError]

    def mean(self, name: str | None = None) -> float:
        """Mean of one function's scores, or of the totals when ``name`` is None."""
        values = self.total if name is None else self.scores[name]
        return sum(values) / len(values) if values else 0.0

    def error_counts(self) -> dict[str, int]:
        """Failed samples per function (every function listed)."""
        return error_counts(self.errors, self.scores)


def error_counts(errors: Iterable[RewardError], names: Iterable[str] = ()) -> dict[str, int]:
    """Failures per reward function name; every name of ``names`` is listed (0 when none)."""
    counts = {name: 0 for name in names}
    for e in errors:
        counts[e.function] = counts.get(e.function, 0) + 1
    return counts


def reward_error_metrics(errors: Iterable[RewardError], names: Iterable[str] = ()) -> dict[str, int]:
    """``reward/errors/<fn>`` metrics: the failed samples of each reward function."""
    from rltt.telemetry.schema import reward_errors_key

    return {reward_errors_key(name): n for name, n in error_counts(errors, names).items()}


class RewardErrorLog:
    """``RUN_DIR/reward_errors.jsonl``: one JSON line per written failure (step, prompt id,
    function, message, occurrence). Of each (function, kind of failure) the first ``first`` are
    written, then every ``every``-th, so a reward failing on every sample cannot flood the disk.

    ``resume_step``: a resumed run drops the lines of the steps it redoes (``step >
    resume_step``; all of them for 0) and continues the occurrence counts.
    """

    def __init__(self, path: str | Path, resume_step: int | None = None, first: int = 5, every: int = 100):
        self.path = Path(path)
        self.first, self.every = first, every
        self.counts: Counter = Counter()
        if self.path.exists():
            from rltt.telemetry import read_metrics, truncate_metrics

            if resume_step is not None:
                truncate_metrics(self.path, resume_step if resume_step > 0 else -1)
            for record in read_metrics(self.path):
                key = (record.get("function"), record.get("kind"))
                self.counts[key] = max(self.counts[key], int(record.get("occurrence", 0)))

    def write(self, errors: Iterable[RewardError]) -> int:
        """Append the errors the rate limit lets through; returns how many were written."""
        lines = []
        for e in errors:
            key = (e.function, e.kind)
            self.counts[key] += 1
            n = self.counts[key]
            if n <= self.first or n % self.every == 0:
                record = {"step": e.step, "prompt_id": e.prompt_id, "function": e.function, "kind": e.kind,
                          "message": e.message[:2000], "occurrence": n}
                if n == self.first:
                    record["note"] = f"further errors of this kind: every {self.every}th is written"
                lines.append(json.dumps(record, default=str) + "\n")
        if lines:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.writelines(lines)
        return len(lines)


class RewardRunner:
    """Score completions with several weighted reward functions; failures score 0 and are recorded.

    ``step``: set by the training loop each step; recorded with each error. ``error_log``: where
    errors are written (see :meth:`open_error_log`). ``workers``: processes of the pool that runs
    the isolated rewards (started on first use; :meth:`close` stops them).
    """

    def __init__(self, rewards: Sequence[WeightedReward], workers: int | None = None,
                 error_log: RewardErrorLog | None = None):
        if not rewards:
            raise RlttError("RewardRunner needs at least one reward function")
        names = [r.name for r in rewards]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise RlttError(f"duplicate reward name(s): {', '.join(duplicates)}")
        self.rewards = list(rewards)
        self.errors: list[RewardError] = []  # every error since construction
        self.step: int | None = None
        self.error_log = error_log
        self._isolated = [r for r in self.rewards if r.isolated]
        self._pool = None
        if self._isolated:
            from rltt.data.reward_pool import RewardPool, default_workers

            self._pool = RewardPool([(r.spec, r.root) for r in self._isolated],
                                    workers if workers is not None else default_workers())

    @classmethod
    def from_specs(
        cls, specs: Mapping[str, float] | Iterable[str | tuple], root: str | Path | None = None,
        workers: int | None = None,
    ) -> "RewardRunner":
        """A runner from ``{spec: weight}`` or a list of specs (weight 1), ``(spec, weight)`` or
        ``(spec, weight, timeout_s)`` tuples."""
        items = specs.items() if isinstance(specs, Mapping) else [(s, 1.0) if isinstance(s, str) else s for s in specs]
        rewards = []
        for item in items:
            spec, weight, *rest = item
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise RlttError(f"reward '{spec}': weight must be a finite number, got {weight!r}")
            timeout = rest[0] if rest else DEFAULT_TIMEOUT_S
            rewards.append(WeightedReward(reward_name(spec), load_reward_fn(spec, root), float(weight), spec=spec,
                                          root=str(root) if root is not None else None, timeout_s=timeout))
        return cls(rewards, workers=workers)

    def open_error_log(self, path: str | Path, resume_step: int | None = None) -> RewardErrorLog:
        """Write this runner's errors to ``path`` (``RUN_DIR/reward_errors.jsonl``) from now on."""
        self.error_log = RewardErrorLog(path, resume_step)
        return self.error_log

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def _in_process(self, reward: WeightedReward, sample: RewardSample) -> tuple[float | None, str | None]:
        from rltt.data.reward_pool import as_score

        try:
            kw = {"prompt_id": sample.prompt_id, **sample.extra}
            return as_score(reward.fn(sample.completion, sample.answer, **kw))
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def score(self, samples: Iterable[RewardSample | tuple]) -> RewardResult:
        """Score ``samples``: ``RewardSample``s or ``(completion, answer, prompt_id)`` tuples."""
        batch = [s if isinstance(s, RewardSample) else RewardSample(*s) for s in samples]
        outcomes: dict[str, list[tuple[float | None, str | None]]] = {}
        if self._isolated and batch:
            from rltt.data.reward_pool import Task

            tasks = [Task(k, s.completion, s.answer, {"prompt_id": s.prompt_id, **s.extra}, r.timeout_s)
                     for k, r in enumerate(self._isolated) for s in batch]
            results = self._pool.run(tasks)
            for k, r in enumerate(self._isolated):
                outcomes[r.name] = results[k * len(batch):(k + 1) * len(batch)]
        for r in self.rewards:
            if not r.isolated:
                outcomes[r.name] = [self._in_process(r, s) for s in batch]
        errors: list[RewardError] = []
        scores: dict[str, list[float]] = {}
        for r in self.rewards:
            values = []
            for sample, (value, error) in zip(batch, outcomes[r.name]):
                if error is not None:
                    errors.append(RewardError(sample.prompt_id, r.name, error, self.step))
                values.append(0.0 if value is None else value)
            scores[r.name] = values
        total = [sum(r.weight * scores[r.name][i] for r in self.rewards) for i in range(len(batch))]
        self.errors.extend(errors)
        if self.error_log is not None and errors:
            self.error_log.write(errors)
        return RewardResult(scores, total, errors)

    def close(self) -> None:
        """Stop the reward worker processes (a later :meth:`score` starts new ones)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
