"""The factories that build a run's rollout engine and learner from its recipe.

A run's orchestration (`rltt.orchestration.parts`) builds its parts here — in this process or
in a Ray actor — and the loop then talks to them only through `RolloutEngine` and
`LearnerAPI`. Which engine and which learner backend are table entries
(`rltt.orchestration.engines.ENGINES`, `rltt.learner.backends.BACKENDS`), never names checked here.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from rltt.learner import Learner
from rltt.learner.backends import BACKENDS
from rltt.model.adapters import attach_adapters
from rltt.orchestration.engines import ENGINES, make_engine as engine_for_section
from rltt.orchestration.train_recipe import TrainRecipe
from rltt.rollout import RolloutEngine


def engine_dtype(recipe: TrainRecipe) -> torch.dtype:
    """The dtype the rollout engine samples in: the learner's (``learner.dtype``), so the sampler
    and the learner score the same numbers up to kernels."""
    return torch.bfloat16 if recipe.learner.dtype == "bf16" else torch.float32


def shares_model(recipe: TrainRecipe) -> bool:
    """A backend that trains the model in place, keeping the model's dtype, and an engine that
    can sample with the learner's module: the engine samples with the very same tensors (its
    weight sync copies nothing)."""
    return (ENGINES[recipe.rollout.engine].in_place and BACKENDS[recipe.learner.backend].in_place
            and recipe.learner.dtype == recipe.model.dtype)


def make_engine(recipe: TrainRecipe, model: torch.nn.Module) -> RolloutEngine:
    """The rollout engine of ``recipe.rollout.engine`` for ``model`` (a `LoopedForCausalLM`).

    Call it before `make_learner`: other backends than an in-place learner need a separate
    copy, taken before DeepSpeed wraps (and under ZeRO-3 partitions) the learner's model; an
    engine that loads its own copy (vLLM) saves that copy once for its loader."""
    prompt = recipe.data.max_prompt_tokens  # a multi-turn episode's later turns are prompted with prompt + history
    env = getattr(recipe, "env", None)
    overrides = {"prompt_tokens": prompt + (env.max_tokens if env is not None and env.enabled else 0)}
    lora = recipe.learner.lora
    mode = ENGINES[recipe.rollout.engine].adapters(recipe.rollout) if lora is not None else None
    if mode == "model":
        attach_adapters(model, lora.spec(), recipe.seed)  # the learner's, drawn alike
    elif mode == "served":
        overrides["lora"] = lora.spec()  # the engine loads the adapters the learner sends as its own LoRA
    if shares_model(recipe):
        return engine_for_section(recipe.rollout, model, **overrides)
    copied = copy.deepcopy(model).eval().to(engine_dtype(recipe))
    return engine_for_section(recipe.rollout, copied, **overrides)


def completion_budget(recipe: TrainRecipe) -> int:
    """The longest completion of a row: ``rollout.max_new_tokens``, or a multi-turn episode's
    ``env.max_tokens`` (model and environment tokens; Dr. GRPO's constant normaliser)."""
    env = getattr(recipe, "env", None)
    return env.max_tokens if env is not None and env.enabled else recipe.rollout.max_new_tokens


def make_learner(recipe: TrainRecipe, model: torch.nn.Module, world: int = 1, run_dir: Path | None = None,
                 model_path: Path | None = None) -> Learner:
    """The learner of ``recipe.learner`` / ``recipe.algorithm`` for ``model``; with ``world``
    data-parallel ranks each trains on its 1/world of the step's batch. ``run_dir``: the run's
    directory (a DeepSpeed learner writes ``deepspeed_config.json`` there). ``model_path``: the
    directory ``model`` was loaded from, which a LoRA learner's checkpoints name as their base."""
    sync = "merged" if ENGINES[recipe.rollout.engine].adapters(recipe.rollout) == "merged" else "adapters"
    return Learner(model, recipe.learner, recipe.algorithm, batch_size=recipe.batch_size // world,
                   max_len=completion_budget(recipe), rollout_dtype=engine_dtype(recipe), run_dir=run_dir,
                   lora_seed=recipe.seed, sync=sync, base_path=None if model_path is None else str(model_path))
