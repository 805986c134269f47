"""What a Ray actor builds in its own process from the recipe and the model directory, with the
same factories as the local loop (`rltt.orchestration.components`): a rollout worker's engine,
a learner rank's learner. Plain picklable callables, sent to the actors at creation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


def _policy(recipe, model_path: str):
    from rltt.orchestration.policy import load_policy

    r = recipe
    torch.manual_seed(r.seed)  # as the local loop does before loading its model
    model, _ = load_policy(Path(model_path), r.model.dtype, r.model.device, r.model.convert)
    return model


@dataclass
class EngineFromDir:
    """``make_engine(recipe, model)`` on the model directory (a rollout worker's engine)."""

    recipe: object  # TrainRecipe
    model_path: str

    def __call__(self):
        from rltt.orchestration.components import make_engine

        return make_engine(self.recipe, _policy(self.recipe, self.model_path))


@dataclass
class LearnerFromDir:
    """``make_learner(recipe, model, world, run_dir)`` on the model directory (rank ``rank`` of
    ``world``; the process group, when there is one, is already formed)."""

    recipe: object  # TrainRecipe
    model_path: str
    run_dir: str | None = None  # the run's directory, as the learners' checkpoints name it

    def __call__(self, rank: int = 0, world: int = 1):
        from rltt.orchestration.components import make_learner

        run_dir = None if self.run_dir is None else Path(self.run_dir)
        return make_learner(self.recipe, _policy(self.recipe, self.model_path), world, run_dir, Path(self.model_path))
