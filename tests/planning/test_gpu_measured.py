"""The plan against what one GPU measured: recipes/gsm8k.yaml at Ouro-1.4B's shape on an emulated
80 GB card (79.2 GiB), an H200 with torch 2.11 + CUDA 13, 2026-12-04 (bench/gpu_runs/2026-12-04/full.md,
section ``deepspeed``, sub-step ``card80``; the code: bench/gpu_check_deepspeed.py). The phases ran
before the learner's first optimizer step, when AdamW's moments (the plan's ``optimizer``) do not
exist yet: the plan less that component is what those allocated peaks measure."""

import pytest

from rltt.orchestration.train_recipe import load_train_recipe
from rltt.planning import plan_run
from rltt.planning.activations import layer_bytes, norm_bytes
from rltt.planning.footprint import GIB, RUNTIME
from rltt.planning.shapes import model_shape
from tests.planning.helpers import OURO_1_4B
from tests.planning.test_plan import RECIPES

CARD = int(79.2 * GIB)
#: allocated peaks (GiB) the H200 measured, and the plan's phase each is a peak of
MEASURED = {
    "rollout": (("learner.micro_batch_size=4", "learner.activation_checkpointing=false"), "rollout", 56.40),
    "learner_mb4": (("learner.micro_batch_size=4", "learner.activation_checkpointing=false"), "learner", 46.50),
}
OUTSIDE_ALLOCATOR_GIB = 1.293  # CUDA context, NCCL, cuBLAS, measured in the same process


def plan(*overrides):
    recipe = load_train_recipe(RECIPES / "gsm8k.yaml", ["model.path=quickstart", *overrides])
    return plan_run(recipe, OURO_1_4B, CARD, device="cuda")


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_the_plan_before_the_first_step_is_within_2_percent_of_the_allocated_peak(name):
    overrides, phase, measured = MEASURED[name]
    p = plan(*overrides)
    assert p.rollout_rows_per_chunk == 56  # the chunk the run sampled
    allocated = p.phases[phase] - p.components["runtime"] - p.components["optimizer"]
    assert 1.0 <= allocated / (measured * GIB) <= 1.02, (name, allocated / GIB)


def test_the_runtime_term_is_what_the_gpu_held_outside_the_allocator():
    assert RUNTIME["cuda"] / GIB == pytest.approx(OUTSIDE_ALLOCATOR_GIB, abs=0.01)


def test_cuda_counts_the_fused_rms_norm_the_cpu_the_composite_one():
    shape = model_shape(OURO_1_4B)
    d = shape.hidden
    assert norm_bytes(d, 1, 2) == 4 * d + 2 * d + 4  # fp32 upcast, normed bf16, rstd
    assert norm_bytes(d, 1, 2, fused=True) == 2 * d + 2 * d + 4  # bf16 input, the weight product's input, rstd
    assert norm_bytes(d, 1, 4, fused=True) == 4 * d + 4  # fp32: the weight is inside the fused operator
    assert layer_bytes(shape, 2) - layer_bytes(shape, 2, fused_norm=True) == shape.norms_per_layer * 2 * d
    cuda = plan("learner.micro_batch_size=4").components["activations"]
    cpu = plan_run(load_train_recipe(RECIPES / "gsm8k.yaml", ["model.path=quickstart", "model.device=cpu"]),
                   OURO_1_4B, CARD, device="cpu").components["activations"]
    assert cpu - cuda > 3.5 * GIB  # 4 norms a layer × 96 layer calls × 2,556 positions × 2·d bytes
