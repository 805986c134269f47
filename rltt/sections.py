"""Recipe sections every recipe family shares (``train``/``curate``/``eval``, ``pretrain``, ``convert``).

The same thing has the same key everywhere: the run folder is ``logging.run_dir``, the run seed
is the top-level ``seed``, checkpoints are written every ``checkpoint.every`` steps, the model
is placed by ``model.dtype`` / ``model.device``, the loop runs ``train.steps`` steps on
``train.threads`` CPU threads, and prompts are built from ``data.prompt_template``. Each family
extends these classes with its own fields (`rltt.orchestration.train_recipe`, `rltt.lm_training.stage_recipe`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rltt.config import NonNegativeFloat, NonNegativeInt, PositiveInt, recipe_error
from rltt.data.gsm8k import DEFAULT_TEMPLATE
from rltt.errors import ConfigError

Dtype = Literal["fp32", "bf16"]

#: keys of the recipe families before they shared one naming: old dotted key -> new one
STAGE_RENAMED = {
    "output_dir": "logging.run_dir",
    "train.seed": "seed",
    "train.save_every": "checkpoint.every",
    "train.log_every": "logging.every",
    "train.progress": "logging.progress",
    "train.dtype": "model.dtype",
    "train.device": "model.device",
    "data.template": "data.prompt_template",
    "data.hf_split": "data.split",
}
TRAIN_RENAMED = {
    "learner.seed": "seed",
    "output_dir": "logging.run_dir",
    "train.seed": "seed",
    "train.save_every": "checkpoint.every",
}

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device(key: str, device: str) -> None:
    """``device`` is ``auto | cpu | cuda[:i]``. Whether this machine can use it is not the recipe's
    question (``rltt plan`` plans a ``cuda`` recipe on a laptop): the commands that run on the
    device check that first, before they load or write anything (`rltt.runtime.device.require_cuda`)."""
    if not _DEVICE.match(device):
        raise recipe_error(key, f"must be auto | cpu | cuda[:i], got {device!r}")


def check_exit_policy(key: str, spec, num_loops: int | None):
    """``spec`` parsed as ``final | fixed:k | threshold:q | sample`` (k <= ``num_loops`` when known;
    an `ExitPolicy` is only checked against it); None stays None."""
    if spec is None:
        return None
    from rltt.model.exits import ExitPolicy

    try:
        return spec.check(num_loops, key) if isinstance(spec, ExitPolicy) else ExitPolicy.parse(spec, num_loops, key)
    except ConfigError as exc:
        raise recipe_error(key, str(exc).removeprefix(f"{key}: ")) from None


def parsed_exit_policy(section, name: str, key: str, num_loops: int | None = None):
    """The `ExitPolicy` of ``section.<name>`` (its text in the recipe; None: the model's own),
    parsed once per value and kept on the section: a recipe parses its policies when it loads
    (``validate``, against T when known) and what builds `SamplingParams` from it takes the
    parsed policy, so no engine parses one per call. A changed value is parsed again."""
    spec = getattr(section, name)
    kept = section.__dict__.setdefault("_exit_policies", {}).get(name)
    policy = check_exit_policy(key, kept[1] if kept is not None and kept[0] == spec else spec, num_loops)
    section.__dict__["_exit_policies"][name] = (spec, policy)
    return policy


def path_exists(text: str) -> bool:
    """Whether ``text`` names an existing path (False, not an exception, for unusable names)."""
    try:
        return Path(text).expanduser().exists()
    except (OSError, RuntimeError, ValueError):
        return False


def is_file(text: str) -> bool:
    try:
        return Path(text).expanduser().is_file()
    except (OSError, RuntimeError, ValueError):
        return False


def is_dir(text: str) -> bool:
    try:
        return Path(text).expanduser().is_dir()
    except (OSError, RuntimeError, ValueError):
        return False


@dataclass
class ModelPlacement:
    """``dtype`` fp32 | bf16 and ``device`` auto | cpu | cuda[:i] of the model."""

    dtype: Dtype = "fp32"
    device: str = "auto"

    def validate(self) -> None:
        check_device("model.device", self.device)


@dataclass
class DataSection:
    """``source`` and its ``split``; prompts are ``prompt_template`` with ``{question}`` filled;
    ``seed`` orders (and, for synthetic sources, generates) the data."""

    source: str = "synthetic:quickstart"
    split: str = "train"
    prompt_template: str = DEFAULT_TEMPLATE
    seed: int = 0

    def validate(self) -> None:
        if "{question}" not in self.prompt_template:
            raise recipe_error("data.prompt_template", "must contain {question}")

    @property
    def is_synthetic(self) -> bool:
        return self.source == "synthetic" or self.source.startswith("synthetic:")


@dataclass
class TrainSection:
    """``steps`` optimizer steps; ``threads`` torch CPU threads (0 = torch's default);
    ``stop_grace_s``: after a SIGTERM / SIGINT, how long the step in progress may still run before
    it is abandoned (`rltt.runtime.stop`; below a scheduler's usual 30 s before its KILL)."""

    steps: PositiveInt = 20
    threads: NonNegativeInt = 0
    max_consecutive_skips: NonNegativeInt = 3  # non-finite steps in a row (skipped, no update) before the run stops; 0 = never
    stop_grace_s: NonNegativeFloat = 20.0  # after SIGTERM/SIGINT: seconds the step in progress may still run


@dataclass
class LoggingSection:
    """``run_dir``: where metrics, checkpoints and the final model go; ``progress``: a progress bar."""

    run_dir: str = "runs/run"
    progress: bool = True

    def validate(self) -> None:
        if not self.run_dir.strip():
            raise recipe_error("logging.run_dir", "must not be empty")


@dataclass
class CheckpointSection:
    """A checkpoint every ``every`` steps (0 = none on the way) and, if ``save_final``, at the end."""

    every: NonNegativeInt = 10
    save_final: bool = True
    keep_last: NonNegativeInt = 3  # newest checkpoints kept (0 = all)
    keep_every: NonNegativeInt = 0  # also keep every keep_every-th step (0 = none)
