"""``rltt pretrain``: a LoopLM from scratch on local text or the synthetic task (docs/design.md §5)."""

from __future__ import annotations

import torch

from rltt.model import LoopConfig, LoopedForCausalLM
from rltt.lm_training.corpus import Sources, build_tokenizer
from rltt.lm_training.stage_recipe import PretrainRecipe, load_stage_recipe
from rltt.lm_training.stage_loop import StageResult, run_stage


def build_pretrain_model(recipe: PretrainRecipe, sources: Sources):
    """Train the tokenizer, then a fresh `LoopedForCausalLM` from ``model.config``.

    ``vocab_size`` and the bos/eos/pad ids come from the tokenizer (a ``vocab_size`` in the
    recipe is a lower bound, e.g. to round the embedding up).
    """
    tokenizer = build_tokenizer(recipe.tokenizer, sources.train, recipe.data.block_size)
    fields = dict(recipe.model.config)
    fields["vocab_size"] = max(len(tokenizer), int(fields.get("vocab_size", 0)))
    fields.setdefault("max_position_embeddings", max(recipe.data.block_size, 512))
    fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    model = LoopedForCausalLM(LoopConfig(**fields))
    with torch.no_grad():
        model.model.exit_gate.bias.fill_(recipe.model.gate_bias)
    return model, tokenizer


def pretrain(recipe: PretrainRecipe, *, resume: bool = False, on_step=None, recipe_file=None) -> StageResult:
    """Run the pretraining stage described by ``recipe``."""
    return run_stage(recipe, build_pretrain_model, resume=resume, stage="pretrain", on_step=on_step,
                     recipe_file=recipe_file)


def load_pretrain_recipe(path=None, overrides=(), data=None) -> PretrainRecipe:
    return load_stage_recipe("pretrain", path, overrides, data)
