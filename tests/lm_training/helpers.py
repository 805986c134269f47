"""Tiny stage recipes that train in seconds on CPU."""

from rltt.lm_training.stage_recipe import load_stage_recipe

TINY_MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_loops": 3, "max_position_embeddings": 128}


def tiny_pretrain_data(run_dir, **extra) -> dict:
    data = {
        "data": {"source": "synthetic:trivial", "block_size": 48, "held_out_docs": 16},
        "tokenizer": {"kind": "char", "vocab_size": 64, "train_docs": 200},
        "model": {"config": dict(TINY_MODEL)},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"steps": 8, "batch_size": 4, "threads": 1},
        "logging": {"run_dir": str(run_dir), "every": 1, "progress": False},
        "checkpoint": {"every": 4},
        "eval": {"every": 4, "loss_batches": 1, "solve_problems": 4, "solve_batch_size": 4, "max_new_tokens": 8},
    }
    for key, value in extra.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def tiny_pretrain_recipe(run_dir, overrides=(), **extra):
    return load_stage_recipe("pretrain", data=tiny_pretrain_data(run_dir, **extra), overrides=overrides)
