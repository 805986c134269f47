"""Reward functions from spec strings, and a runner that scores completions with them.

A reward function is ``fn(completion: str, answer: str, **kw) -> float``. Recipes name one
by a spec string:

- ``"rewards/gsm8k.py:strict"`` — a Python file and a function in it; a relative path is
  looked up under ``root`` (default: the current directory), then under the rltt source
  checkout; if no file is found, ``rewards/NAME.py`` falls back to the installed module
  ``rewards.NAME``;
- ``"rewards.gsm8k:strict"`` — an importable module and a function in it.

``RewardRunner`` applies several weighted functions to a batch. A function that raises (or
returns something that is not a finite number) scores 0 for that sample, the failure is
recorded as a ``RewardError`` (prompt id, function name, message), and scoring goes on.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping, Sequence

from rltt.errors import RlttError

RewardFn = Callable[..., float]

# the directory holding the rltt package (a source checkout has rewards/ beside it)
_PROJECT_ROOT = Path(__file__).resolve().parents[2]
_FILE_MODULES: dict[Path, ModuleType] = {}


def _split_spec(spec: str) -> tuple[str, str]:
    target, sep, name = spec.rpartition(":")
    # "C:\\x\\r.py:fn" keeps the drive colon in target; a spec needs a non-empty function name
    if not sep or not target or not name or not name.isidentifier():
        raise RlttError(f"bad reward spec '{spec}': expected FILE.py:FUNCTION or module.path:FUNCTION")
    return target, name


def _load_file_module(path: Path) -> ModuleType:
    path = path.resolve()
    if path in _FILE_MODULES:
        return _FILE_MODULES[path]
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"rltt_reward_{stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RlttError(f"reward file cannot be imported: {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except RlttError:
        raise
    except Exception as exc:
        del sys.modules[module_name]
        raise RlttError(f"reward file {path} failed to import: {type(exc).__name__}: {exc}") from None
    _FILE_MODULES[path] = module
    return module


def _import_module(name: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):  # the module itself (or a parent) is missing
            raise RlttError(f"reward spec '{spec}': no module '{name}'") from None
        raise RlttError(f"reward module '{name}' failed to import: {exc}") from None
    except Exception as exc:
        raise RlttError(f"reward module '{name}' failed to import: {type(exc).__name__}: {exc}") from None


def _resolve_module(target: str, spec: str, root: Path | None) -> ModuleType:
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser()
        candidates = [path] if path.is_absolute() else [(root or Path.cwd()) / path, _PROJECT_ROOT / path]
        for candidate in candidates:
            if candidate.is_file():
                return _load_file_module(candidate)
        parts = Path(target).with_suffix("").parts
        if not path.is_absolute() and len(parts) == 2 and parts[0] == "rewards":
            try:  # an installed rltt: rewards/ is a package, not a folder on disk
                return importlib.import_module(f"rewards.{parts[1]}")
            except ImportError:
                pass
        raise RlttError(
            f"reward file not found: {target} (from spec '{spec}'; looked in "
            + ", ".join(str(c.parent) for c in dict.fromkeys(candidates))
            + ")"
        )
    return _import_module(target, spec)


def load_reward_fn(spec: str, root: str | Path | None = None) -> RewardFn:
    """The reward function a spec string names (see the module docstring)."""
    target, name = _split_spec(spec)
    module = _resolve_module(target, spec, Path(root) if root is not None else None)
    fn = getattr(module, name, None)
    if fn is None:
        available = sorted(
            k for k, v in vars(module).items() if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise RlttError(
            f"reward spec '{spec}': no function '{name}' in {target} (it defines: {', '.join(available) or 'nothing'})"
        )
    if not callable(fn):
        raise RlttError(f"reward spec '{spec}': '{name}' in {target} is not a function")
    return fn


def reward_name(spec: str) -> str:
    """A short display name for a spec: ``"rewards/gsm8k.py:strict"`` -> ``"gsm8k.strict"``."""
    target, name = _split_spec(spec)
    stem = Path(target).stem if (target.endswith(".py") or "/" in target) else target.rsplit(".", 1)[-1]
    return f"{stem}.{name}"


@dataclass
class WeightedReward:
    """A reward function, its weight in the total, and its name in logs."""

    name: str
    fn: RewardFn
    weight: float = 1.0


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

    def __str__(self) -> str:
        return f"reward {self.function} failed on prompt {self.prompt_id}: {self.message}"


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


class RewardRunner:
    """Score completions with several weighted reward functions; failures score 0 and are recorded."""

    def __init__(self, rewards: Sequence[WeightedReward]):
        if not rewards:
            raise RlttError("RewardRunner needs at least one reward function")
        names = [r.name for r in rewards]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise RlttError(f"duplicate reward name(s): {', '.join(duplicates)}")
        self.rewards = list(rewards)
        self.errors: list[RewardError] = []  # every error since construction

    @classmethod
    def from_specs(
        cls, specs: Mapping[str, float] | Iterable[str | tuple[str, float]], root: str | Path | None = None
    ) -> "RewardRunner":
        """A runner from ``{spec: weight}`` or a list of specs (weight 1) / ``(spec, weight)`` pairs."""
        items = specs.items() if isinstance(specs, Mapping) else [(s, 1.0) if isinstance(s, str) else s for s in specs]
        rewards = []
        for spec, weight in items:
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise RlttError(f"reward '{spec}': weight must be a finite number, got {weight!r}")
            rewards.append(WeightedReward(reward_name(spec), load_reward_fn(spec, root), float(weight)))
        return cls(rewards)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def _score_one(self, reward: WeightedReward, sample: RewardSample, errors: list[RewardError]) -> float:
        try:
            kw = {"prompt_id": sample.prompt_id, **sample.extra}
            value = reward.fn(sample.completion, sample.answer, **kw)
        except Exception as exc:
            errors.append(RewardError(sample.prompt_id, reward.name, f"{type(exc).__name__}: {exc}"))
            return 0.0
        if isinstance(value, bool):
            return float(value)
        try:
            value = float(value)
        except (TypeError, ValueError):
            errors.append(RewardError(sample.prompt_id, reward.name, f"returned {type(value).__name__}, not a number"))
            return 0.0
        if not math.isfinite(value):
            errors.append(RewardError(sample.prompt_id, reward.name, f"returned {value}"))
            return 0.0
        return value

    def score(self, samples: Iterable[RewardSample | tuple]) -> RewardResult:
        """Score ``samples``: ``RewardSample``s or ``(completion, answer, prompt_id)`` tuples."""
        batch = [s if isinstance(s, RewardSample) else RewardSample(*s) for s in samples]
        errors: list[RewardError] = []
        scores = {r.name: [self._score_one(r, s, errors) for s in batch] for r in self.rewards}
        total = [sum(r.weight * scores[r.name][i] for r in self.rewards) for i in range(len(batch))]
        self.errors.extend(errors)
        return RewardResult(scores, total, errors)
