"""The rollout-correction table (docs/design.md §5.6): weights against the formulas written out token
by token, masked tokens contributing exactly nothing, the ``tis_cap`` alias."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.errors import RlttError
from rltt.learner import AlgorithmConfig
from rltt.objectives import CORRECTIONS, CorrectionParams, correction_weights, policy_loss

PARAMS = CorrectionParams(cap=2.0, lo=0.5, hi=3.0, decoupled_cap=2.5)


def naive_weights(kind, learner, sampler, mask, p):
    """(weight, masked) per token from the formulas, one sequence at a time."""
    B, S = len(learner), len(learner[0])
    weight = [[0.0] * S for _ in range(B)]
    masked = [[False] * S for _ in range(B)]
    for b in range(B):
        tokens = [j for j in range(S) if mask[b][j]]
        deltas = {j: learner[b][j] - sampler[b][j] for j in tokens}
        seq = math.fsum(deltas.values())  # log W
        geo = seq / len(tokens) if tokens else 0.0  # log Ḡ
        for j in tokens:
            w = math.exp(deltas[j])
            if kind == "none":
                c = 1.0
            elif kind == "token_tis":
                c = min(w, p.cap)
            elif kind == "seq_tis":
                c = min(math.exp(seq), p.cap)
            elif kind == "token_mask":
                c = w if p.lo <= w <= p.hi else 0.0
            elif kind == "seq_mask":
                c = math.exp(seq) if p.lo <= math.exp(seq) <= p.hi else 0.0
            elif kind == "geo_mask":
                c = 1.0 if p.lo <= math.exp(geo) <= p.hi else 0.0
            else:  # decoupled: π_prox/π_behav, masked above its cap
                c = w if w <= p.decoupled_cap else 0.0
            weight[b][j] = c
            masked[b][j] = (kind.endswith("mask") or kind == "decoupled") and c == 0.0
    return weight, masked


@st.composite
def mismatched(draw):
    B, S = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    lengths = [draw(st.integers(0, S)) for _ in range(B)]
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    sampler = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    noise = draw(st.sampled_from([1e-3, 0.3, 1.5]))
    learner = sampler + noise * torch.randn(B, S, generator=g, dtype=torch.float64)
    return learner, sampler, mask


@pytest.mark.parametrize("kind", list(CORRECTIONS))
@settings(max_examples=30, deadline=None)
@given(data=mismatched())
def test_every_correction_matches_its_formula(kind, data):
    learner, sampler, mask = data
    out = correction_weights(kind, learner, sampler, mask, PARAMS)
    weight, masked = naive_weights(kind, learner.tolist(), sampler.tolist(), mask.tolist(), PARAMS)
    torch.testing.assert_close(out.weight, torch.tensor(weight, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert out.masked.tolist() == masked
    assert not bool((out.masked & ~mask).any()) and not bool((out.weight[~mask] != 0).any())


@pytest.mark.parametrize("kind", ["token_mask", "seq_mask", "geo_mask", "decoupled"])
@pytest.mark.parametrize("loss", ["ppo_clip", "reinforce", "gspo", "cispo"])
def test_masked_tokens_contribute_exactly_nothing(kind, loss):
    g = torch.Generator().manual_seed(0)
    B, S = 4, 5
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[3, 3:] = False
    sampler = -torch.rand(B, S, generator=g, dtype=torch.float64) - 0.5
    learner = sampler.clone()
    learner[0, 1:3] += 3.0  # row 0: two tokens far outside [0.5, 3] (and its sequence ratios with them)
    learner[2, :] -= 1.0  # row 2: every token below the band
    old = learner.clone()
    logp0 = old + 1e-5 * torch.randn(B, S, generator=g, dtype=torch.float64)  # inside every clip range
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)

    def run(logp_init):
        logp = logp_init.clone().requires_grad_(True)
        out = policy_loss(logp, old, adv, mask, kind=loss, correction=kind, correction_params=PARAMS,
                          behaviour_logp=sampler, rollout_logp=learner)
        out.loss.backward()
        return out, logp.grad

    out, grad = run(logp0)
    masked = correction_weights(kind, learner, sampler, mask, PARAMS).masked
    low_edge = kind != "decoupled"  # decoupled masks above its cap only
    assert bool(masked[0].any()) and bool(masked[2].all()) == low_edge and not bool(masked[1].any())
    assert torch.equal(grad[masked], torch.zeros(int(masked.sum()), dtype=torch.float64))
    assert bool((grad[mask & ~masked] != 0).all())
    # whatever the policy does on a masked token (even an extreme log-prob), the loss and the
    # other tokens' gradients stay bit for bit the same
    moved = logp0.clone()
    moved[masked] = torch.where(torch.rand(int(masked.sum()), generator=g) > 0.5, -1e6, 50.0).double()
    out2, grad2 = run(moved)
    assert out2.loss.item() == out.loss.item()
    assert torch.equal(grad2, grad)
    # the unmasked share: the correction's counts
    assert out.correction_masked.item() == int(masked.sum()) and out.correction_tokens.item() == int(mask.sum())


def test_tis_cap_is_the_token_tis_correction():
    g = torch.Generator().manual_seed(2)
    sampler = -torch.rand(2, 4, generator=g, dtype=torch.float64)
    old = sampler + 0.8 * torch.randn(2, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    outs = []
    for kwargs in ({"tis_cap": 1.5}, {"correction": "token_tis", "correction_params": CorrectionParams(cap=1.5)}):
        logp = old.clone().requires_grad_(True)
        out = policy_loss(logp, old, adv, mask, kind="reinforce", behaviour_logp=sampler, **kwargs)
        out.loss.backward()
        outs.append((out.loss.item(), logp.grad, out.tis_capped_fraction.item()))
    assert outs[0][0] == outs[1][0] and torch.equal(outs[0][1], outs[1][1]) and outs[0][2] == outs[1][2] > 0
    algo = AlgorithmConfig(tis_cap=1.5)
    assert (algo.correction, algo.correction_cap) == ("token_tis", 1.5)
    with pytest.raises(RlttError, match="algorithm.tis_cap"):
        AlgorithmConfig(tis_cap=1.5, correction="seq_mask")
    with pytest.raises(RlttError, match="cannot be combined"):
        policy_loss(old, old, adv, mask, tis_cap=1.5, correction="geo_mask", behaviour_logp=sampler)


def test_correction_menu_and_checks():
    assert tuple(CORRECTIONS) == ("none", "token_tis", "seq_tis", "token_mask", "seq_mask", "geo_mask", "decoupled")
    x = torch.zeros(1, 2)
    with pytest.raises(RlttError, match="needs behaviour_logp"):
        policy_loss(x, x, torch.ones(1), torch.ones(1, 2), correction="token_mask")
    with pytest.raises(RlttError, match="lo < hi"):
        correction_weights("token_mask", x, x, torch.ones(1, 2), CorrectionParams(lo=2.0, hi=1.0))
    with pytest.raises(RlttError, match="algorithm.correction_lo"):
        AlgorithmConfig(correction="token_mask", correction_lo=5.0, correction_hi=2.0)
    with pytest.raises(RlttError, match="algorithm.correction"):
        AlgorithmConfig(correction="icepop")
    # a long sequence whose ratio overflows is capped (seq_tis) or masked (seq_mask), never inf/NaN
    big = torch.full((1, 400), 3.0, dtype=torch.float64)
    zero = torch.zeros(1, 400, dtype=torch.float64)
    keep = torch.ones(1, 400, dtype=torch.bool)
    assert torch.equal(correction_weights("seq_tis", big, zero, keep).weight, torch.full((1, 400), 2.0,
                                                                                           dtype=torch.float64))
    masked = correction_weights("seq_mask", big, zero, keep)
    assert bool(masked.masked.all()) and torch.equal(masked.weight, zero)


def test_decoupled_ppo_against_a_hand_computation():
    """AReaL's decoupled PPO: ℓ_j = −(π_prox/π_behav)_j · min(ρ_j A, clip(ρ_j, 0.8, 1.28) A) with
    ρ_j = π_θ/π_prox, a token whose behaviour weight exceeds decoupled_cap (5) masked, token_mean
    over the 5 completion tokens (the masked one still counts)."""
    ln = math.log
    prox = torch.tensor([[ln(0.5), ln(0.4), ln(0.2)], [ln(0.5), ln(0.25), 0.0]], dtype=torch.float64)
    behav = torch.tensor([[ln(0.25), ln(0.05), ln(0.4)], [ln(0.5), ln(0.2), 0.0]], dtype=torch.float64)
    now = torch.tensor([[ln(0.6), ln(0.4), ln(0.3)], [ln(0.3), ln(0.25), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    # by hand, token by token (w = π_prox/π_behav, ρ = π_θ/π_prox):
    #   row 0, A = 1:  w 2,    ρ 1.2: unclipped, ℓ = −2 · 1.2          = −2.4,  ∂ℓ/∂logp = −2 · 1.2 = −2.4
    #                  w 8 > 5: masked,          ℓ = 0,                         ∂ = 0
    #                  w 0.5,  ρ 1.5 > 1.28: clipped, ℓ = −0.5 · 1.28  = −0.64, ∂ = 0
    #   row 1, A = −2: w 1,    ρ 0.6 < 0.8: clipped, ℓ = −1 · (0.8 · −2) = 1.6, ∂ = 0
    #                  w 1.25, ρ 1: unclipped, ℓ = −1.25 · (1 · −2)   = 2.5,   ∂ = 1.25 · 2 = 2.5
    want_loss = (-2.4 + 0.0 - 0.64 + 1.6 + 2.5) / 5
    want_grad = torch.tensor([[-2.4, 0.0, 0.0], [0.0, 2.5, 0.0]], dtype=torch.float64) / 5
    logp = now.clone().requires_grad_(True)
    out = policy_loss(logp, prox, adv, mask, kind="ppo_clip", eps_low=0.2, eps_high=0.28, correction="decoupled",
                      behaviour_logp=behav)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(want_loss, rel=1e-12)
    torch.testing.assert_close(logp.grad, want_grad, rtol=1e-12, atol=1e-12)
    assert out.correction_masked.item() == 1 and out.correction_tokens.item() == 5
    assert out.correction_weight_max.item() == pytest.approx(2.0) and out.correction_weight_sum.item() == pytest.approx(4.75)
    # the cap is the recipe's key: at 10 the w = 8 token is kept (ρ = 1, A = 1: ℓ = −8)
    logp = now.clone().requires_grad_(True)
    out = policy_loss(logp, prox, adv, mask, kind="ppo_clip", eps_low=0.2, eps_high=0.28, correction="decoupled",
                      correction_params=CorrectionParams(decoupled_cap=10.0), behaviour_logp=behav)
    assert out.loss.item() == pytest.approx(want_loss - 8.0 / 5, rel=1e-12)


def test_decoupled_recipe_keys():
    algo = AlgorithmConfig(correction="decoupled")
    assert algo.decoupled_cap == 5.0
    assert AlgorithmConfig(correction="decoupled", decoupled_cap=2.0).decoupled_cap == 2.0
    for kwargs, key in (({"decoupled_cap": 0.0}, "algorithm.decoupled_cap"),
                        ({"loss": "reinforce"}, "algorithm.correction")):
        with pytest.raises(RlttError) as err:
            AlgorithmConfig(correction="decoupled", **kwargs)
        assert key in str(err.value) and "\n" not in str(err.value)
