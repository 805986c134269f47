"""bench/gpu_check_deepspeed.py's card phases: which allocator settings they run under, and the
optimizer state they report (the CUDA runs themselves need a GPU)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_check_deepspeed as gcd  # noqa: E402

from rltt.runtime.allocator import ENV  # noqa: E402


@pytest.mark.parametrize("setting, first, second", [
    ("expandable_segments:True", True, (".fixed_segments", "expandable_segments:False", False)),
    ("expandable_segments:False", False, (".expandable_segments", "expandable_segments:True", True)),
    (None, False, (".expandable_segments", "expandable_segments:True", True)),  # PyTorch's default: fixed
])
def test_cuda_runs_each_phase_under_the_setting_in_force_then_the_other(monkeypatch, setting, first, second):
    if setting is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, setting)
    modes = gcd.allocator_modes(SimpleNamespace(cuda=True))
    assert modes[0][0] == "" and modes[0][2] is first  # plain figure names: the setting in force
    assert modes[1] == second and len(modes) == 2


def test_the_cpu_runs_once_without_an_allocator():
    assert gcd.allocator_modes(SimpleNamespace(cuda=False)) == [("", "none (CPU)", None)]


def test_optimizer_state_bytes_counts_adamw_moments_after_the_first_step():
    import torch

    param = torch.nn.Parameter(torch.zeros(1000))
    opt = torch.optim.AdamW([param])
    learner = SimpleNamespace(backend=SimpleNamespace(optimizer=opt))
    assert gcd.optimizer_state_bytes(learner) == 0
    param.grad = torch.ones(1000)
    opt.step()
    assert gcd.optimizer_state_bytes(learner) >= 2 * 4 * 1000  # exp_avg, exp_avg_sq (and the step count)
    wrapped = SimpleNamespace(backend=SimpleNamespace(optimizer=SimpleNamespace(optimizer=opt)))  # DeepSpeed's
    assert gcd.optimizer_state_bytes(wrapped) == gcd.optimizer_state_bytes(learner)
