"""rltt convert: the dense builder, T = 1 parity with the dense model, a short conversion run."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rltt.lm_training.conversion import build_converted_model, convert
from rltt.lm_training.corpus import open_sources
from rltt.lm_training.stage_recipe import load_stage_recipe
from rltt.telemetry import read_metrics


def convert_data(tmp_path, **model):
    return {
        "model": {"dense_path": str(tmp_path / "dense"), "num_loops": 3, "injection": "scalar",
                  "create_dense_if_missing": {"config": {"hidden_size": 32, "intermediate_size": 64,
                                                         "num_hidden_layers": 2, "num_attention_heads": 2,
                                                         "num_key_value_heads": 1, "head_dim": 16},
                                              "steps": 3}, **model},
        "data": {"source": "synthetic:trivial", "block_size": 48, "held_out_docs": 16},
        "tokenizer": {"kind": "char", "vocab_size": 64, "train_docs": 200},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"steps": 4, "batch_size": 4, "threads": 1},
        "logging": {"run_dir": str(tmp_path / "run"), "every": 1, "progress": False},
        "checkpoint": {"every": 2},
        "eval": {"every": 4, "loss_batches": 1, "solve_problems": 2, "solve_batch_size": 2, "max_new_tokens": 4},
    }


def test_conversion_at_one_loop_equals_dense(tmp_path):
    recipe = load_stage_recipe("convert", data=convert_data(tmp_path, num_loops=1, injection="none"))
    looped, tokenizer = build_converted_model(recipe, open_sources(recipe.data))
    assert (tmp_path / "dense" / "config.json").is_file() and (tmp_path / "dense" / "tokenizer.json").is_file()
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("Question: Ann has 3 apples.\nAnswer:")])
    with torch.no_grad():
        want = dense(input_ids=ids).logits
        got = looped.eval()(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_short_conversion_run(tmp_path):
    recipe = load_stage_recipe("convert", data=convert_data(tmp_path))
    result = convert(recipe)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "exit/p_3" in records[-1] and "eval/lm_loss" in records[-1]
    from rltt.model import load_looped

    model = load_looped(result.final_dir)
    assert model.config.num_loops == 3 and model.config.injection == "scalar"


def test_missing_dense_checkpoint_is_one_line(tmp_path):
    from rltt.errors import RlttError

    data = convert_data(tmp_path)
    data["model"].pop("create_dense_if_missing")
    with pytest.raises(RlttError) as info:
        load_stage_recipe("convert", data=data)
    assert "model.dense_path" in str(info.value) and str(tmp_path / "dense") in str(info.value)
