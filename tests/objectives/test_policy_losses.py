"""The policy-loss table (docs/design.md §5.6): every loss against a naive reference written from
its paper's formula, token by token, on random tensors with ragged masks — values and gradients."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.errors import RlttError
from rltt.objectives import AGGREGATIONS, POLICY_LOSSES, policy_loss
from rltt.objectives.rl import PolicyLossKind
from rltt.learner import AlgorithmConfig

EPS = {"ppo_clip": (0.2, 0.28), "reinforce": (None, None), "gspo": (3e-4, 4e-4), "cispo": (None, 3.0)}


def clip(x, lo, hi):
    return torch.clamp(x, lo, hi)


def naive_aggregate(rows, agg, max_len):
    """rows: per sequence, the list of its tokens' losses (torch scalars)."""
    if agg == "token_mean":
        n = sum(len(r) for r in rows)
        return sum((x for r in rows for x in r), torch.zeros((), dtype=torch.float64)) / max(n, 1)
    if agg == "seq_mean_token_mean":
        means = [sum(r, torch.zeros((), dtype=torch.float64)) / len(r) for r in rows if r]
        return sum(means, torch.zeros((), dtype=torch.float64)) / max(len(means), 1)
    return sum((sum(r, torch.zeros((), dtype=torch.float64)) / max_len for r in rows),
               torch.zeros((), dtype=torch.float64)) / len(rows)


def naive_loss(kind, logp, old, adv, mask, eps_low, eps_high, agg, max_len):
    """The papers' objectives, one token (or sequence) at a time, with autograd through them."""
    rows = []
    for b in range(logp.shape[0]):
        tokens = [j for j in range(logp.shape[1]) if mask[b, j]]
        a = adv[b]
        row = []
        if kind == "gspo":
            # GSPO: s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|), the sequence objective min(s A, clip(s) A),
            # the gradient flowing through s itself; every token of the sequence carries it
            if tokens:
                s = torch.exp(sum(logp[b, j] - old[b, j] for j in tokens) / len(tokens))
                seq = -torch.minimum(s * a, clip(s, 1 - eps_low, 1 + eps_high) * a)
                row = [seq for _ in tokens]
        for j in tokens if kind != "gspo" else ():
            rho = torch.exp(logp[b, j] - old[b, j])
            if kind == "ppo_clip":
                row.append(-torch.minimum(rho * a, clip(rho, 1 - eps_low, 1 + eps_high) * a))
            elif kind == "reinforce":
                row.append(-a * logp[b, j])
            elif kind == "cispo":
                weight = torch.clamp(rho, max=1 + eps_high).detach()  # sg(clip(ρ, −∞, 1 + ε_high))
                row.append(-weight * a * logp[b, j])
        rows.append(row)
    return naive_aggregate(rows, agg, max_len)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    S = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    lengths = [draw(st.integers(0, S)) for _ in range(B)]
    if sum(lengths) == 0:
        lengths[0] = 1
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    spread = draw(st.sampled_from([0.0, 1e-4, 0.05, 0.5]))  # on-policy, GSPO-sized, PPO-sized, far
    logp = old + spread * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


@pytest.mark.parametrize("kind", list(POLICY_LOSSES))
@settings(max_examples=25, deadline=None)
@given(data=batches(), agg=st.sampled_from(AGGREGATIONS))
def test_every_loss_matches_its_formula_in_value_and_gradient(kind, data, agg):
    logp0, old, adv, mask = data
    eps_low, eps_high = EPS[kind]
    logp = logp0.clone().requires_grad_(True)
    out = policy_loss(logp, old, adv, mask, kind=kind, agg=agg, max_len=8)  # the loss's default ε
    out.loss.backward()
    ref_logp = logp0.clone().requires_grad_(True)
    ref = naive_loss(kind, ref_logp, old, adv, mask, eps_low, eps_high, agg, 8)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-9, abs=1e-12)
    if ref.requires_grad:
        ref.backward()
        expected = ref_logp.grad
    else:  # nothing unclipped: the reference has no graph, the gradient is zero
        expected = torch.zeros_like(logp0)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_gspo_on_one_token_sequences_is_token_level_ppo_clip(agg):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 1, generator=g, dtype=torch.float64)
    logp0 = old + 0.3 * torch.randn(6, 1, generator=g, dtype=torch.float64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.ones(6, 1, dtype=torch.bool)
    results = []
    for kind in ("gspo", "ppo_clip"):
        logp = logp0.clone().requires_grad_(True)
        out = policy_loss(logp, old, adv, mask, kind=kind, eps_low=0.2, eps_high=0.28, agg=agg, max_len=1)
        out.loss.backward()
        results.append((out, logp.grad))
    (gspo, g_grad), (ppo, p_grad) = results
    assert gspo.loss.item() == pytest.approx(ppo.loss.item(), rel=1e-12)
    torch.testing.assert_close(g_grad, p_grad, rtol=1e-12, atol=0)
    assert gspo.clip_fraction.item() == ppo.clip_fraction.item() > 0


def test_gspo_clips_whole_sequences_at_its_small_default_range():
    old = torch.zeros(2, 3, dtype=torch.float64)
    # sequence 0: mean log-ratio 1e-4 (inside 1 + 4e-4); sequence 1: 1e-3 (outside), A > 0 for both
    logp = torch.tensor([[1e-4, 1e-4, 1e-4], [3e-3, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    out = policy_loss(logp, old, torch.tensor([1.0, 1.0], dtype=torch.float64), torch.ones(2, 3, dtype=torch.bool),
                      kind="gspo")
    out.loss.backward()
    assert (logp.grad[0] != 0).all() and torch.equal(logp.grad[1], torch.zeros(3, dtype=torch.float64))
    assert out.clip_high_fraction.item() == pytest.approx(0.5)  # the 3 tokens of sequence 1
    # every token of the unclipped sequence gets s·A / N: the sequence ratio, not its own ratio
    s = math.exp(1e-4)
    torch.testing.assert_close(logp.grad[0], torch.full((3,), -s / 6, dtype=torch.float64))


def test_cispo_gradient_is_the_clipped_weight_reinforce_gradient():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    logp0 = old + 1.5 * torch.randn(3, 5, generator=g, dtype=torch.float64)  # many ratios beyond the cap
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.2
    cap = 1.0 + 3.0
    weight = torch.exp(logp0 - old).clamp(max=cap)
    assert bool(((torch.exp(logp0 - old) > cap) & mask).any())
    logp = logp0.clone().requires_grad_(True)
    cispo = policy_loss(logp, old, adv, mask, kind="cispo")
    cispo.loss.backward()
    logp_r = logp0.clone().requires_grad_(True)
    reinforce = policy_loss(logp_r, None, adv[:, None] * weight, mask, kind="reinforce")
    reinforce.loss.backward()
    torch.testing.assert_close(logp.grad, logp_r.grad, rtol=1e-12, atol=0)
    assert cispo.loss.item() == pytest.approx(reinforce.loss.item(), rel=1e-12)
    # no token is dropped: every unmasked token keeps a gradient, even where PPO-clip zeroes it
    assert bool((logp.grad[mask] != 0).all())
    logp_p = logp0.clone().requires_grad_(True)
    policy_loss(logp_p, old, adv, mask, kind="ppo_clip").loss.backward()
    assert bool((logp_p.grad[mask] == 0).any())
    assert cispo.clip_high_fraction.item() == pytest.approx(
        float(((torch.exp(logp0 - old) > cap) & mask).sum() / mask.sum()))


def test_loss_table_is_the_recipe_menu():
    assert PolicyLossKind.__args__ == tuple(POLICY_LOSSES) == ("ppo_clip", "reinforce", "gspo", "cispo")
    for name, spec in POLICY_LOSSES.items():
        for key in spec.eps_keys:  # every ε a loss reads is a documented recipe key
            assert key is None or hasattr(AlgorithmConfig(), key), (name, key)
    algo = AlgorithmConfig(loss="gspo")
    assert (algo.gspo_eps_low, algo.gspo_eps_high, algo.cispo_eps_high) == (3e-4, 4e-4, 3.0)
    with pytest.raises(RlttError, match="algorithm.loss"):
        AlgorithmConfig(loss="grpo")
    with pytest.raises(RlttError, match="algorithm.gspo_eps_low"):
        AlgorithmConfig(gspo_eps_low=1.0)
    with pytest.raises(RlttError, match="algorithm.cispo_eps_high"):
        AlgorithmConfig(cispo_eps_high=-1.0)
    with pytest.raises(RlttError, match="needs old_logp"):
        policy_loss(torch.zeros(1, 1), None, torch.ones(1), torch.ones(1, 1), kind="gspo")
    with pytest.raises(RlttError, match="eps_low"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), kind="gspo", eps_low=1.5)
