"""Recipe keys of the vLLM engine (rollout.engine, rollout.vllm.*) and the engine factory (no vLLM needed)."""

from __future__ import annotations

import pytest

from rltt.errors import RlttError
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.rollout import NativeEngine
from rltt.orchestration.engines import make_engine, vllm_options
from tests.vllm.helpers import looped_model, needs_vllm


def test_vllm_recipe_keys_load():
    recipe = load_train_recipe(None, ["rollout.engine=vllm", "rollout.schedule=dense", "rollout.vllm.kv_cache_gb=2",
                                      "rollout.vllm.max_model_len=512", "rollout.vllm.tensor_parallel_size=2",
                                      "rollout.vllm.enforce_eager=true"])
    assert recipe.rollout.engine == "vllm"
    options = vllm_options(recipe.rollout)
    assert options["kv_cache_gb"] == 2 and options["max_model_len"] == 512
    assert options["tensor_parallel_size"] == 2 and options["enforce_eager"] is True
    assert options == recipe.rollout.vllm.engine_options()
    assert load_train_recipe(None, []).rollout.engine == "native"


@pytest.mark.parametrize("overrides, key", [
    (["rollout.engine=vllm"], "rollout.schedule"),  # the default schedule is deferred
    (["rollout.engine=sglang"], "rollout.engine"),
    (["rollout.engine=vllm", "rollout.schedule=dense", "rollout.vllm.kv_cache_gb=0"], "rollout.vllm.kv_cache_gb"),
    (["rollout.vllm.gpu_memory_utilization=1.5"], "rollout.vllm.gpu_memory_utilization"),
    (["rollout.vllm.tensor_parallel_size=0"], "rollout.vllm.tensor_parallel_size"),
    (["rollout.vllm.max_model_len=1"], "rollout.vllm.max_model_len"),
    (["rollout.vllm.block_size=16"], "rollout.vllm.block_size"),
])
def test_bad_vllm_recipe_keys_name_the_key(overrides, key):
    with pytest.raises(RlttError, match=f"'{key}'") as err:
        load_train_recipe(None, overrides)
    assert "\n" not in str(err.value)


def test_make_engine_native_and_bad_names():
    model = looped_model(num_loops=2)
    engine = make_engine({"engine": "native"}, model)
    assert isinstance(engine, NativeEngine) and engine.model is model
    with pytest.raises(RlttError, match="'rollout.engine'"):
        make_engine({"engine": "tgi"}, model)


# -- engine sizing and temporary files (no vLLM engine started) -----------------------------------

def test_engine_sizes_from_the_recipe():
    from rltt.vllm.vllm_engine import engine_sizes, recipe_sizing

    recipe = load_train_recipe(None, ["rollout.engine=vllm", "rollout.schedule=dense", "rollout.prompts_per_step=4",
                                      "rollout.group_size=8", "rollout.max_new_tokens=48"])
    sizing = recipe_sizing(recipe.rollout)
    assert sizing == {"new_tokens": 48, "step_rows": 32}
    config = looped_model(num_loops=2, max_position_embeddings=1024).config
    assert engine_sizes(config, None, None, prompt_tokens=100, **sizing) == (148, 32)
    assert engine_sizes(config, 512, 7, prompt_tokens=100, **sizing) == (512, 7)  # set in rollout.vllm: kept
    assert engine_sizes(config, None, None, prompt_tokens=5000, **sizing) == (1024, 32)  # the model's positions
    assert engine_sizes(config, None, None) == (1024, 256)  # nothing known: positions, vLLM's usual 256
    # chunk_rows caps the rows; a thinking budget can make completions longer than max_new_tokens
    capped = load_train_recipe(None, ["rollout.engine=vllm", "rollout.schedule=dense", "rollout.prompts_per_step=4",
                                      "rollout.group_size=8", "rollout.chunk_rows=16", "rollout.max_new_tokens=64",
                                      "rollout.thinking.budget=40", "rollout.thinking.interruption=</think>",
                                      "rollout.thinking.answer_budget=30"])
    assert recipe_sizing(capped.rollout) == {"new_tokens": 40 + len("</think>") + 30, "step_rows": 16}
    assert recipe_sizing({"max_new_tokens": 8, "prompts_per_step": 2, "group_size": 3}) == {"new_tokens": 8,
                                                                                            "step_rows": 6}
    # the recipe's rollout.vllm leaves them open (null) unless set
    assert recipe.rollout.vllm.max_num_seqs is None and recipe.rollout.vllm.max_model_len is None
    assert recipe.rollout.vllm.sleep is None


def test_kv_cache_too_small_for_one_sequence_names_the_keys():
    from rltt.vllm.vllm_engine import GIB, kv_bytes_per_token, kv_fit_error
    from rltt.model import LoopConfig

    # an Ouro-1.4B-sized looped model (T = 4, L = 24, 16 KV heads of 128) in bf16 on an 80 GiB GPU
    cfg = LoopConfig(vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                     num_attention_heads=16, num_key_value_heads=16, head_dim=128, num_loops=4)
    per_token = kv_bytes_per_token(cfg, 2)
    assert per_token == 2 * 4 * 24 * 16 * 128 * 2  # 0.75 MiB a token: T·L slots
    assert kv_bytes_per_token(cfg, 2, tensor_parallel_size=2) == per_token // 2
    line = kv_fit_error(per_token=per_token, max_model_len=32768, share=0.1 * 80 * GIB, weights=2.8 * GIB, cpu=False,
                        share_setting="rollout.vllm.gpu_memory_utilization=0.1")
    assert line is not None and "\n" not in line
    assert "max_model_len=32768 needs 24.00 GiB" in line and "rollout.vllm.gpu_memory_utilization" in line
    assert "rollout.vllm.max_model_len" in line and "after 2.80 GiB of weights" in line
    assert kv_fit_error(per_token=per_token, max_model_len=4096, share=0.5 * 80 * GIB, weights=2.8 * GIB, cpu=False,
                        share_setting="x") is None
    cpu = kv_fit_error(per_token=per_token, max_model_len=4096, share=1 * GIB, weights=0, cpu=True,
                       share_setting="rollout.vllm.kv_cache_gb=1")
    assert cpu is not None and "raise rollout.vllm.kv_cache_gb" in cpu


@needs_vllm
def test_an_engine_that_cannot_fit_fails_before_vllm_starts(monkeypatch):
    import vllm

    from rltt.vllm.vllm_engine import VllmEngine

    monkeypatch.setattr(vllm, "LLM", lambda **kw: pytest.fail("vLLM was started"))
    with pytest.raises(RlttError, match="max_model_len=1000000 needs .*rollout.vllm.kv_cache_gb") as err:
        VllmEngine(looped_model(num_loops=2), kv_cache_gb=1, max_model_len=1_000_000)
    assert "\n" not in str(err.value)


def test_temporary_files_leave_dev_shm_when_it_is_short(tmp_path, monkeypatch):
    from pathlib import Path

    from rltt.vllm import vllm_engine
    from rltt.vllm.vllm_engine import SHM, SHM_HEADROOM, scratch_dir_for

    free = {"bytes": 10 * 1024**3}
    monkeypatch.setattr(vllm_engine, "_free_bytes", lambda path: free["bytes"])
    if not Path(SHM).is_dir():
        pytest.skip("no /dev/shm here")
    assert scratch_dir_for(1024**3, str(tmp_path)) == SHM
    free["bytes"] = 1024**3 + SHM_HEADROOM  # room for the file, not for the file and the headroom
    assert scratch_dir_for(1024**3, str(tmp_path)) == str(tmp_path / "vllm-tmp")
    assert (tmp_path / "vllm-tmp").is_dir()
    assert scratch_dir_for(1024**3) is None  # no run directory: the system temp directory
    # the model an engine saves for vLLM goes where there is room for it
    free["bytes"] = 0
    model = looped_model(num_loops=2)
    engine = object.__new__(vllm_engine.VllmEngine)
    engine.scratch_dir = str(tmp_path / "run")
    path = Path(engine._save(model))
    try:
        assert path.parent == tmp_path / "run" / "vllm-tmp" and (path / "config.json").exists()
    finally:
        import shutil

        shutil.rmtree(path)


def test_factory_options_with_the_recipes_sizes():
    """What `rltt.orchestration.engines._vllm` hands `VllmEngine` once it adds `recipe_sizing`:
    the recipe's sizes under rollout.vllm's options and the caller's (data.max_prompt_tokens)."""
    from rltt.vllm.vllm_engine import recipe_sizing

    recipe = load_train_recipe(None, ["rollout.engine=vllm", "rollout.schedule=dense", "rollout.prompts_per_step=2",
                                      "rollout.group_size=4", "rollout.max_new_tokens=20",
                                      "rollout.vllm.max_num_seqs=5"])
    options = {**recipe_sizing(recipe.rollout), **vllm_options(recipe.rollout), "prompt_tokens": 30}
    assert options["new_tokens"] == 20 and options["step_rows"] == 8
    assert options["max_num_seqs"] == 5 and options["prompt_tokens"] == 30 and options["sleep"] is None
