"""rltt.planning.engine_memory: one row per rollout engine, and each row agrees with what the
orchestration builds (whether the native engine shares the learner's tensors)."""

from pathlib import Path

import pytest

from rltt.errors import RlttError
from rltt.orchestration.components import shares_model
from rltt.orchestration.engines import ENGINES
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.planning import plan_run
from rltt.planning.engine_memory import ENGINE_MEMORY, ROLLOUT, engine_memory, vllm_asleep_bytes
from rltt.planning.footprint import GIB
from rltt.planning.run_settings import RunSettings
from tests.planning.helpers import OURO_1_4B

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_every_rollout_engine_has_a_memory_row():
    assert set(ENGINE_MEMORY) == set(ENGINES)
    with pytest.raises(RlttError, match="rollout.engine='sglang'.*native, vllm"):
        engine_memory("sglang")


@pytest.mark.parametrize("engine", ["native", "vllm"])
@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
@pytest.mark.parametrize("dtypes", [("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")])
def test_shared_weights_match_what_the_orchestration_builds(engine, backend, dtypes):
    model_dtype, learner_dtype = dtypes
    recipe = load_train_recipe(RECIPES / "gsm8k.yaml", [
        "model.path=quickstart", f"rollout.engine={engine}", f"learner.backend={backend}",
        f"model.dtype={model_dtype}", f"learner.dtype={learner_dtype}", "rollout.schedule=dense"])
    s = RunSettings.from_recipe(recipe, "cuda", 1)
    assert engine_memory(engine).shares_model(s) == shares_model(recipe)
    plan = plan_run(recipe, OURO_1_4B, 80 * GIB, device="cuda")
    copy = plan.components["engine_copy"]
    assert (copy == 0) == (engine == "vllm" or shares_model(recipe))
    if engine == "vllm":  # its share holds the KV; no native buffers; asleep in the update (on by default)
        share = int(recipe.rollout.vllm.gpu_memory_utilization * 80 * GIB)
        assert plan.components["vllm"] + plan.components["vllm_woken"] == share
        assert plan.components["vllm"] == vllm_asleep_bytes(s) < share
        assert all(plan.components[k] == 0 for k in ROLLOUT if k != "vllm_woken")
    else:
        assert plan.components["vllm"] == 0 and plan.components["rollout_kv"] > 0
