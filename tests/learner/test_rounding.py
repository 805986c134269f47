"""``learner.rounding``: the fp32 masters of a bf16 learner rounded into its module weights to nearest (the
default: `Tensor.copy_`) or stochastically — each result one of the two bf16 neighbours, the master in
expectation, the draws keyed by (update, tensor) so that a resumed run rounds as the uninterrupted one."""

import pytest
import torch

from rltt.errors import RlttError
from rltt.learner import AlgorithmConfig, Learner, LearnerConfig
from rltt.learner.rounding import ROUNDINGS, round_stochastic

from .helpers import synthetic_batch, tiny_policy


def _neighbours(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above each fp32 value in magnitude (truncation and one ulp up)."""
    bits = master.view(torch.int32)
    down = (bits & -(1 << 16)).view(torch.float32)
    up = ((bits & -(1 << 16)) + (1 << 16)).view(torch.float32)
    return down, up


def test_stochastic_rounding_is_one_neighbour_and_the_master_in_expectation():
    gen = torch.Generator().manual_seed(0)
    master = (torch.randn(64, generator=gen) * 0.02).float()
    master[:4] = torch.tensor([0.015625, -0.5, 1.0, -3.5])  # exact in bf16: never moved
    down, up = _neighbours(master)
    draws = []
    for update in range(2000):
        p = torch.empty(64, dtype=torch.bfloat16)
        round_stochastic(p, master, update, 3)
        got = p.float()
        assert torch.all((got == down) | (got == up))
        draws.append(got)
    mean = torch.stack(draws).double().mean(0)
    ulp = (up - down).double().abs()
    # the mean of 2000 draws of a two-point variable is within 5 standard errors (≤ ulp / (2·√2000)) of its expectation
    assert torch.all((mean - master.double()).abs() <= 5 * ulp / (2 * 2000 ** 0.5))
    assert torch.equal(draws[0][:4], master[:4]) and torch.equal(draws[-1][:4], master[:4])
    # round to nearest is biased where stochastic is not: it moves no element whose fraction is below half
    nearest = master.to(torch.bfloat16).float().double()
    assert (nearest - master.double()).abs().max() > (mean - master.double()).abs().max()


def test_the_draws_are_keyed_by_update_and_tensor():
    master = torch.randn(256).float() * 0.02
    a, b, c, d = (torch.empty(256, dtype=torch.bfloat16) for _ in range(4))
    round_stochastic(a, master, 5, 1)
    round_stochastic(b, master, 5, 1)
    round_stochastic(c, master, 6, 1)
    round_stochastic(d, master, 5, 2)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)
    fp16 = torch.empty(256, dtype=torch.float16)
    round_stochastic(fp16, master, 5, 1)  # other dtypes: to nearest
    assert torch.equal(fp16, master.to(torch.float16))


def _learner(rounding: str, lr: float = 1e-7) -> Learner:
    return Learner(tiny_policy(seed=0), LearnerConfig(dtype="bf16", lr=lr, micro_batch_size=2, rounding=rounding),
                   AlgorithmConfig(track_kl=False), batch_size=4, max_len=8)


def test_updates_below_half_an_ulp_reach_the_weights_only_when_rounded_stochastically():
    fractions = {}
    for rounding in ROUNDINGS:
        learner = _learner(rounding)
        fractions[rounding] = [learner.update(synthetic_batch(B=4, seed=s))["sync/changed_frac"] for s in range(3)]
    assert max(fractions["nearest"]) < 0.002  # weights ~0.02, steps ~1e-7: almost nothing moves
    # each element moves with probability |step| / ulp (measured 0.005, 0.011, 0.017 over the 3 updates)
    assert min(fractions["stochastic"]) > 3 * max(fractions["nearest"])


def test_nearest_is_the_default_and_a_plain_copy():
    assert LearnerConfig().rounding == "nearest"
    master = torch.randn(100).float()
    a, b = torch.empty(100, dtype=torch.bfloat16), torch.empty(100, dtype=torch.bfloat16)
    ROUNDINGS["nearest"](a, master, 3, 0)
    b.copy_(master)
    assert torch.equal(a, b)


def test_a_resumed_stochastic_run_rounds_as_the_uninterrupted_one(tmp_path):
    ran = _learner("stochastic", lr=1e-4)
    ran.update(synthetic_batch(seed=0))
    ran.save(tmp_path / "ckpt")
    for seed in (1, 2):
        ran.update(synthetic_batch(seed=seed))
    resumed = _learner("stochastic", lr=1e-4)
    resumed.load(tmp_path / "ckpt")
    for seed in (1, 2):
        resumed.update(synthetic_batch(seed=seed))
    for (name, a), b in zip(ran.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_stochastic_rounding_is_a_torch_backend_option():
    with pytest.raises(RlttError, match="learner.rounding"):
        LearnerConfig(backend="deepspeed", zero_stage=2, dtype="bf16", rounding="stochastic")
