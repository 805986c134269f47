"""Recipe keys of the vLLM engine (rollout.engine, rollout.vllm.*) and the engine factory (no vLLM needed)."""

from __future__ import annotations

import pytest

from rltt.errors import RlttError
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.rollout import NativeEngine
from rltt.orchestration.engines import make_engine, vllm_options
from tests.vllm.helpers import looped_model


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
