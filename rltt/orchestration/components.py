"""The factories that build a run's rollout engine and learner from its recipe.

The loop (and, next, a Ray driver) builds its parts here and then talks to them only through
`RolloutEngine` and `Learner`; another engine (vLLM) or learner (a Ray learner group) plugs in
by adding a branch to these factories (the engines themselves: `rltt.orchestration.engines`).
"""

from __future__ import annotations

import copy

import torch

from rltt.learner import Learner
from rltt.orchestration.train_recipe import TrainRecipe
from rltt.rollout import NativeEngine, RolloutEngine
from rltt.orchestration.engines import make_engine as engine_for_section


def engine_dtype(recipe: TrainRecipe) -> torch.dtype:
    """The dtype the rollout engine samples in: the learner's (``learner.dtype``), so the sampler
    and the learner score the same numbers up to kernels."""
    return torch.bfloat16 if recipe.learner.dtype == "bf16" else torch.float32


def shares_model(recipe: TrainRecipe) -> bool:
    """The torch learner trains the model in place; when it keeps the model's dtype the native
    engine samples with the very same tensors (its weight sync copies nothing)."""
    return (recipe.rollout.engine == "native" and recipe.learner.backend == "torch"
            and recipe.learner.dtype == recipe.model.dtype)


def make_engine(recipe: TrainRecipe, model: torch.nn.Module) -> RolloutEngine:
    """The rollout engine of ``recipe.rollout.engine`` for ``model`` (a `LoopedForCausalLM`).

    Call it before `make_learner`: other backends than an in-place torch learner need a separate
    copy, taken before DeepSpeed wraps (and under ZeRO-3 partitions) the learner's model."""
    if shares_model(recipe):
        return NativeEngine(model)
    copied = copy.deepcopy(model).eval().to(engine_dtype(recipe))
    if recipe.rollout.engine == "native":
        return NativeEngine(copied)
    return engine_for_section(recipe.rollout, copied)  # vLLM: the copy is saved once for its loader


def make_learner(recipe: TrainRecipe, model: torch.nn.Module, world: int = 1) -> Learner:
    """The learner of ``recipe.learner`` / ``recipe.algorithm`` for ``model``; with ``world``
    data-parallel ranks each trains on its 1/world of the step's batch."""
    return Learner(model, recipe.learner, recipe.algorithm, batch_size=recipe.batch_size // world,
                   max_len=recipe.rollout.max_new_tokens, rollout_dtype=engine_dtype(recipe))
