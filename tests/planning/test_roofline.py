"""The rollout roofline (`rltt.planning.roofline`): device names to data-sheet figures, and the bound's
arithmetic against sums written out by hand and against a built model's tensors and a real rollout's counts."""

import pytest
import torch

from rltt.model import LoopConfig, LoopedForCausalLM
from rltt.planning.roofline import DeviceSpec, RolloutWork, device_spec, rollout_roofline
from rltt.planning.shapes import ModelShape, model_shape
from rltt.planning.sources import model_config
from tests.planning.helpers import OURO_1_4B, config_folder


@pytest.mark.parametrize("name, table", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM 40GB"), ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB"), ("NVIDIA L40S", "L40S"), ("NVIDIA L40", "L40"), ("NVIDIA L4", "L4"),
    ("NVIDIA A10", "A10"), ("NVIDIA GH200 480GB", "GH200"), ("H100 PCIe", "H100 PCIe"), ("A100 SXM 40GB", "A100 SXM 40GB"),
])
def test_device_names_find_their_figures(name, table):
    spec = device_spec(name)
    assert spec is not None and spec.name == table
    assert device_spec(spec.name) == spec  # a table name finds itself


def test_unknown_devices_have_no_figures():
    assert device_spec("cpu") is None and device_spec("NVIDIA GeForce RTX 4090") is None
    assert device_spec("NVIDIA H200").bandwidth == 4.8e12 and device_spec("NVIDIA H200").bf16_flops == 989e12


def test_the_bound_at_ouro_1_4b_written_out(tmp_path):
    config, _ = model_config(str(config_folder(tmp_path, OURO_1_4B)))
    shape = model_shape(config)
    V, d, F, L, H, D = 49152, 2048, 5632, 24, 16, 128
    layer = 4 * d * H * D + 3 * d * F + 4 * d  # q, k, v, o + MLP + sandwich norms
    work = RolloutWork(passes=132, row_passes=32 * 132, entries=32 * (32 * 4 + 32 * 4), tokens=32 * 32, steps=32,
                       context=32 + 16)
    h200 = DeviceSpec("H200", 4.8e12, 989e12)
    bound = rollout_roofline(shape, 2, work, h200)
    nbytes = 132 * L * layer * 2 + 32 * V * d * 2 + 32 * 132 * 48 * L * 2 * H * D * 2
    flops = work.entries * 2 * L * (4 * d * H * D + 3 * d * F) + 1024 * 2 * V * d + 32 * 132 * 4 * 48 * H * D * L
    assert bound.bytes == nbytes and bound.flops == flops
    assert bound.memory_s == pytest.approx(nbytes / 4.8e12) and bound.compute_s == pytest.approx(flops / 989e12)
    assert bound.limit == "memory" and bound.seconds == bound.memory_s
    assert bound.tokens_per_s == pytest.approx(1024 / bound.memory_s)
    assert bound.fraction(2 * bound.seconds) == pytest.approx(0.5)
    # a device of little compute is compute-bound on the same work
    slow = rollout_roofline(shape, 2, work, DeviceSpec("x", 4.8e12, 1e12))
    assert slow.limit == "compute" and slow.seconds == pytest.approx(flops / 1e12)


def test_the_counts_come_from_the_model_and_a_rollout():
    """W_block is the layers' tensors' bytes; RolloutWork.of reads a real call's stats."""
    from rltt.rollout import NativeEngine, SamplingParams

    config = LoopConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_loops=3)
    torch.manual_seed(0)
    model = LoopedForCausalLM(config).eval()
    shape = ModelShape.of(config)
    layers = sum(p.numel() for p in model.model.layers.parameters())
    assert shape.layers * shape.layer_parameters() == layers
    out = NativeEngine(model).generate([[1, 2, 3, 4], [5, 6, 7, 8]], SamplingParams(
        temperature=0.0, max_new_tokens=5, schedule="deferred", exit_policy="sample", seed=0, ignore_eos=True))
    work = RolloutWork.of(out.stats, prompt_len=4, new_tokens=5)
    assert work.tokens == 10 and work.passes == out.stats.passes and work.row_passes == int(out.stats.row_passes.sum())
    assert work.entries == out.stats.entries_computed and work.context == 6.5
    spec = DeviceSpec("unit", 1.0, 1.0)  # one byte and one FLOP per second: the bound is the counts themselves
    bound = rollout_roofline(shape, 4, work, spec)
    assert bound.memory_s == pytest.approx(work.passes * layers * 4 + 5 * 64 * 32 * 4
                                           + work.row_passes * 6.5 * 2 * 2 * 2 * 8 * 4)
