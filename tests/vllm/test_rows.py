"""The vLLM-free parts of the vLLM path: per-row exit decisions equal the native engine's, and rltt
imports (and reports a missing vLLM in one line) without vllm installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rltt.errors import RlttError
from rltt.model.exits import ExitPolicy, exit_distribution
from rltt.rollout.sampler import ExitDecider, RowRandom
from rltt.vllm.row_exits import RowExits, choose_exits, row_keys, uniforms_from_keys


def test_uniforms_from_keys_are_row_random_draws():
    for prompt_seeds, n in ((None, 1), ([3, 99, 2**40], 2)):
        random = RowRandom(1234, "cpu", 6, prompt_seeds, n)
        keys = torch.tensor(row_keys(1234, 6, prompt_seeds, n))
        rows, counters = torch.tensor([0, 3, 5, 1]), torch.tensor([0, 7, 2, 30])
        for stream in (RowRandom.TOKEN, RowRandom.EXIT):
            assert torch.equal(uniforms_from_keys(keys[rows], counters, stream), random.uniform(rows, counters, stream))


@pytest.mark.parametrize("spec", ["final", "fixed:2", "threshold:0.3", "threshold:0.7", "sample"])
def test_choose_exits_equals_the_native_step_by_step_decision(spec):
    T, n = 4, 64
    gates = torch.rand(T, n, generator=torch.Generator().manual_seed(0))
    policy = ExitPolicy.parse(spec, T)
    random = RowRandom(5, "cpu", n)
    counters = torch.arange(n) % 7
    decider = ExitDecider(policy, T, random, n)
    decider.uniform = random.uniform(torch.arange(n), counters, RowRandom.EXIT).cpu()
    want = torch.full((n,), 0, dtype=torch.long)
    for step in range(1, T + 1):  # the native engine decides after each computed step
        undecided = (want == 0).nonzero().flatten().tolist()
        if not undecided:
            break
        yes = decider.exits(undecided, torch.full((len(undecided),), step), gates[:, undecided])
        want[torch.tensor(undecided)[yes]] = step
    rows = RowExits.build([policy] * n, row_keys(5, n), counters.tolist())
    assert torch.equal(choose_exits(gates, rows), want)
    if spec != "sample":
        assert torch.equal(choose_exits(gates, RowExits.uniform_policy(policy, n)),
                           policy.choose(exit_distribution(gates)))


def test_mixed_policies_in_one_batch():
    gates = torch.rand(3, 4, generator=torch.Generator().manual_seed(1))
    policies = [ExitPolicy.parse(s, 3) for s in ("final", "fixed:1", "threshold:0.5", "fixed:2")]
    got = choose_exits(gates, RowExits.build(policies, [0, 0, 0, 0], [0, 0, 0, 0]))
    assert got[0] == 3 and got[1] == 1 and got[3] == 2
    assert got[2] == ExitPolicy.parse("threshold:0.5", 3).choose(exit_distribution(gates[:, 2:3]))[0]


def test_rltt_imports_and_errors_without_vllm(tmp_path):
    """With vllm unimportable, rltt and the engine factory import, and asking for vLLM is a one-line error."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import rltt, rltt.rollout, rltt.orchestration.engines, rltt.vllm.vllm_engine, rltt.vllm.row_exits\n"
        "from rltt.errors import RlttError\n"
        "from rltt.orchestration.engines import make_engine\n"
        "try:\n"
        "    make_engine({'engine': 'vllm'}, None)\n"
        "except RlttError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip()
    assert line.startswith("ERR rollout.engine=vllm needs vLLM") and "pip install 'rltt[vllm]'" in line
    assert "\n" not in line


def test_head_dim_below_64_is_a_one_line_error_on_cpu():
    from rltt.model import LoopConfig
    from rltt.vllm.vllm_engine import VllmEngine

    cfg = LoopConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                     num_attention_heads=2, num_loops=2)
    with pytest.raises(RlttError, match="head_dim >= 64.*head_dim=32") as err:
        VllmEngine.check_config(cfg, cpu=True)
    assert "\n" not in str(err.value)
    VllmEngine.check_config(cfg, cpu=False)  # GPU attention takes it
    with pytest.raises(RlttError, match="lora_rank"):
        VllmEngine.check_config(LoopConfig(vocab_size=64, hidden_size=128, intermediate_size=96, num_hidden_layers=1,
                                           num_attention_heads=2, num_loops=2, lora_rank=2), cpu=True)
