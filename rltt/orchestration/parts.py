"""What a training run is built from, and how a run in this process builds it.

The loop (`rltt.orchestration.trainer.Trainer`) is written once. Where its parts live is a
choice of *orchestration*, a table entry (`rltt.orchestration.trainer.ORCHESTRATIONS`), each an
`Orchestration`: how the run's ranks are found (checked before any file is written) and a
builder of its `RunParts` — the tokenizer, the rollout engine, the learner, the training step
that drives them, and what to release at the end. ``local`` (this module) builds them in this
process (one process, or every rank of a torchrun/DeepSpeed run); ``ray`` builds them on Ray
actors (`rltt.orchestration.ray.driver`). A new orchestration is one more builder, not a
subclass of the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rltt.errors import RlttError
from rltt.learner import LearnerAPI
from rltt.learner.backends import BACKENDS
from rltt.orchestration.components import make_engine, make_learner
from rltt.orchestration.policy import load_policy
from rltt.orchestration.step import TrainingStep
from rltt.orchestration.train_recipe import TrainRecipe
from rltt.rollout import RolloutEngine
from rltt.runtime.distributed import Ranks, ranks_from_env


def _nothing() -> None:
    return None


@dataclass
class RunParts:
    """A run's parts. ``step``: builds the run's `TrainingStep` from its arguments (the class
    itself, or a step that also samples ahead); ``release``: what the builder started besides the
    engine and the learner (a Ray cluster), called after both are closed."""

    tokenizer: Any
    engine: RolloutEngine
    learner: LearnerAPI
    step: Callable[..., TrainingStep] = TrainingStep
    release: Callable[[], None] = field(default=_nothing)


class PartDied(RlttError):
    """A part of the run died in a way the run can recover from by rebuilding its parts and
    resuming from ``checkpoint`` (None: from the start), up to `Orchestration.restarts` times."""

    def __init__(self, message: str, checkpoint: Path | None):
        super().__init__(message)
        self.checkpoint = checkpoint


#: builds a run's parts: (recipe, model directory, run directory, ranks, restarts so far) -> RunParts
Builder = Callable[[TrainRecipe, Path, Path, Ranks, int], RunParts]


@dataclass(frozen=True)
class Orchestration:
    """Where a run's parts live. ``ranks``: this process's place in the run, from the recipe and
    the launcher (a one-line error for a layout the recipe cannot run); ``build``: the parts;
    ``planned_ranks``: how many devices share the model's training state (the memory plan's
    ``gpus``); ``restarts_key``: the recipe key limiting how often a `PartDied` may rebuild them (none: never);
    ``rebuilds``: what a rebuild replaces, in words."""

    ranks: Callable[[TrainRecipe], Ranks]
    build: Builder
    planned_ranks: Callable[[TrainRecipe, Ranks], int] = lambda recipe, ranks: ranks.world
    restarts_key: str | None = None
    rebuilds: str = "the run's parts"

    def restarts(self, recipe: TrainRecipe) -> int:
        """The recipe's limit on rebuilds (0 without ``restarts_key``)."""
        if self.restarts_key is None:
            return 0
        value = recipe
        for name in self.restarts_key.split("."):
            value = getattr(value, name)
        return int(value)


def local_ranks(recipe: TrainRecipe) -> Ranks:
    """One process, or this rank of a torchrun launch (checked against the recipe)."""
    data_parallel = [name for name, backend in BACKENDS.items() if backend.data_parallel]
    return ranks_from_env(recipe.learner.backend, recipe.rollout.prompts_per_step, data_parallel)


def build_local_parts(recipe: TrainRecipe, model_path: Path, run_dir: Path, ranks: Ranks,
                      restarts: int = 0) -> RunParts:
    """The policy loaded here; the engine takes the model before the learner wraps it."""
    r = recipe
    model, tokenizer = load_policy(model_path, r.model.dtype, r.model.device, r.model.convert)
    engine = make_engine(r, model)
    return RunParts(tokenizer, engine, make_learner(r, model, ranks.world, run_dir, model_path))


LOCAL = Orchestration(ranks=local_ranks, build=build_local_parts)
