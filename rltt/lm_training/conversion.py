"""``rltt convert``: dense HF checkpoint → LoopLM, trained with the smoothed exit loss (docs/design.md §5).

``model.dense_path`` is a local Qwen3 / Qwen2 / Llama checkpoint. With
``model.create_dense_if_missing`` a small dense Qwen3 is first built there (tokenizer trained
on the recipe's data, optionally pretrained densely for a few steps) — the CPU conversion
recipe and the tests use that, since nothing can be downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from rltt.data.tokenizer import load_tokenizer
from rltt.errors import RlttError
from rltt.model import loopify
from rltt.runtime.checkpoint import atomic_dir
from rltt.lm_training.corpus import Sources, build_tokenizer, train_packer
from rltt.lm_training.stage_recipe import ConvertRecipe, DenseBuilder, load_stage_recipe
from rltt.lm_training.stage_loop import StageResult, run_stage


def create_dense(path: Path, builder: DenseBuilder, recipe: ConvertRecipe, sources: Sources) -> Path:
    """Build (and briefly pretrain) a small dense Qwen3 with a local tokenizer at ``path``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer(recipe.tokenizer, sources.train, recipe.data.block_size)
    fields = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": max(512, recipe.data.block_size),
              "tie_word_embeddings": False, **builder.config}
    fields.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    try:
        config = Qwen3Config(**fields)
    except (TypeError, ValueError) as exc:
        raise RlttError(f"model.create_dense_if_missing.config: {str(exc).splitlines()[0]}") from None
    torch.manual_seed(builder.seed)
    dense = Qwen3ForCausalLM(config)
    if builder.steps:
        packer = train_packer(sources, tokenizer, recipe.data)
        optimizer = torch.optim.AdamW(dense.parameters(), lr=builder.lr, weight_decay=0.0)
        dense.train()
        for _ in tqdm(range(builder.steps), desc="dense", disable=not recipe.logging.progress):
            batch = packer.batch(recipe.train.batch_size)
            loss = dense(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def write(tmp: Path) -> None:
        dense.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return atomic_dir(Path(path), write)


def build_converted_model(recipe: ConvertRecipe, sources: Sources):
    """The dense checkpoint (created first if asked) wrapped by ``loopify``, and its tokenizer."""
    m = recipe.model
    path = Path(m.dense_path)
    if not (path / "config.json").is_file():
        if m.create_dense_if_missing is None:
            raise RlttError(f"model.dense_path: no dense checkpoint (config.json) at {path}")
        create_dense(path, m.create_dense_if_missing, recipe, sources)
    model = loopify(path, num_loops=m.num_loops, injection=m.injection, injection_init=m.injection_init,
                    carry_normed_state=m.carry_normed_state, gate_bias=m.gate_bias, lora_rank=m.lora_rank)
    if recipe.tokenizer.path is not None:
        tokenizer = load_tokenizer(recipe.tokenizer.path)
    elif (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer = load_tokenizer(path)
    else:
        raise RlttError(f"tokenizer.path: {path} has no tokenizer; set tokenizer.path")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def convert(recipe: ConvertRecipe, *, resume: bool = False, on_step=None, recipe_file=None) -> StageResult:
    """Run the conversion stage described by ``recipe``."""
    return run_stage(recipe, build_converted_model, resume=resume, stage="convert", on_step=on_step,
                     recipe_file=recipe_file)


def load_convert_recipe(path=None, overrides=(), data=None) -> ConvertRecipe:
    return load_stage_recipe("convert", path, overrides, data)
