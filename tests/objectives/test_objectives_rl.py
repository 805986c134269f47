"""rltt.objectives.rl against hand computations (docs/design.md §5)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.errors import RlttError
from rltt.objectives import (
    aggregate,
    group_advantages,
    kl_estimate,
    policy_loss,
    uniform_groups,
)

# ---------------------------------------------------------------- advantages


def test_group_advantages_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    out = group_advantages(rewards, 4, eps=0.0)
    # group 1: mean .25, sample std sqrt((.75² + 3·.25²)/3) = .5
    # group 2: mean .5, sample std sqrt(4·.25/3)
    s2 = math.sqrt(1.0 / 3.0)
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.5 / s2, 0.5 / s2, -0.5 / s2, -0.5 / s2])
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.group_mean, torch.tensor([0.25, 0.5]))
    torch.testing.assert_close(out.group_std, torch.tensor([0.5, s2]))
    assert out.uniform.tolist() == [False, False]


def test_group_advantages_delta_batch_and_none_scales():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    eps = 1e-6
    group = group_advantages(rewards, 2, "group", eps=eps).advantages
    s = math.sqrt(0.5)  # sample std of (1, 0)
    torch.testing.assert_close(group[:2], torch.tensor([0.5, -0.5]) / (s + eps))
    batch = group_advantages(rewards, 2, "batch", eps=eps).advantages
    batch_std = torch.tensor([1.0, 0.0, 3.0, 1.0]).std().item()
    torch.testing.assert_close(batch, torch.tensor([0.5, -0.5, 1.0, -1.0]) / (batch_std + eps))
    none = group_advantages(rewards, 2, "none").advantages
    torch.testing.assert_close(none, torch.tensor([0.5, -0.5, 1.0, -1.0]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_all_equal_group_has_exactly_zero_advantage(scale):
    # for this float32 value r − mean(r, r, r) leaves a rounding residue of ~6e-8, which
    # a division by (std + δ) would blow up into a spurious advantage
    v = 0.7038277387619019
    rewards = torch.tensor([v, v, v, 1.0, 0.0, 1.0, 0.7, 0.7, 0.7])
    grouped = rewards.view(3, 3)
    assert (grouped[0] - grouped.mean(1)[0]).abs().max() > 0
    out = group_advantages(rewards, 3, scale)
    assert torch.equal(out.advantages[:3], torch.zeros(3))
    assert torch.equal(out.advantages[6:], torch.zeros(3))
    assert bool((out.advantages[3:6] != 0).all())
    assert out.uniform.tolist() == [True, False, True]
    assert out.uniform_fraction == pytest.approx(2 / 3)


@settings(max_examples=40, deadline=None)
@given(G=st.integers(1, 5), n=st.integers(1, 4), data=st.data())
def test_group_advantages_centred_and_zero_for_uniform(G, n, data):
    values = data.draw(st.lists(st.sampled_from([0.0, 0.3, 1.0]), min_size=G * n, max_size=G * n))
    rewards = torch.tensor(values, dtype=torch.float64)
    out = group_advantages(rewards, G)
    adv = out.advantages.view(n, G)
    torch.testing.assert_close(adv.sum(1), torch.zeros(n, dtype=torch.float64), atol=1e-9, rtol=0)
    for g in range(n):
        if len(set(values[g * G:(g + 1) * G])) == 1:
            assert bool(out.uniform[g]) and torch.equal(adv[g], torch.zeros(G, dtype=torch.float64))
        else:
            assert not bool(out.uniform[g])


def test_group_advantages_errors():
    with pytest.raises(RlttError, match="group_size=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(RlttError, match="'mean'"):
        group_advantages(torch.zeros(4), 2, scale="mean")
    with pytest.raises(RlttError, match="group_size"):
        group_advantages(torch.zeros(4), 0)


def test_integer_rewards_are_accepted():
    out = group_advantages(torch.tensor([1, 0, 1, 1]), 2, eps=0.0)
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, -0.5, 0.0, 0.0]) / math.sqrt(0.5))


def test_uniform_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert uniform_groups(rewards, 2).tolist() == [True, False, True, False]
    assert uniform_groups(torch.ones(4), 2).tolist() == [True, True]


# ---------------------------------------------------------------- aggregation


def _ragged():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    return x, mask


def test_token_mean_vs_seq_mean_token_mean_on_ragged_mask():
    x, mask = _ragged()
    assert aggregate(x, mask, "token_mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(x, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)


def test_dr_grpo_constant_normaliser():
    x, mask = _ragged()
    assert aggregate(x, mask, "seq_mean_token_sum_norm", max_len=8).item() == pytest.approx((6 / 8 + 4 / 8) / 2)
    # default normaliser: the padded length S
    assert aggregate(x, mask, "seq_mean_token_sum_norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)
    with pytest.raises(RlttError, match="max_len"):
        aggregate(x, mask, "seq_mean_token_sum_norm", max_len=0)


def test_aggregate_gradients_and_edge_cases():
    x, mask = _ragged()
    x = torch.where(mask, x, torch.zeros_like(x)).requires_grad_(True)
    aggregate(x, mask, "seq_mean_token_mean").backward()
    torch.testing.assert_close(x.grad, torch.tensor([[1 / 6, 1 / 6, 1 / 6], [1 / 2, 0, 0]]))
    # an empty row is left out of the sequence mean; an all-masked batch gives 0
    mask2 = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert aggregate(x.detach(), mask2, "seq_mean_token_mean").item() == pytest.approx(1.5)
    assert aggregate(x.detach(), torch.zeros_like(mask2), "token_mean").item() == 0.0
    with pytest.raises(RlttError, match="'sum'"):
        aggregate(x, mask, "sum")


# ---------------------------------------------------------------- policy loss


def _one_token(ratio, adv):
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(ratio), requires_grad=True)
    return logp, old, torch.tensor([adv]), torch.ones(1, 1, dtype=torch.bool)


def test_clip_higher_asymmetry_positive_advantage():
    logp, old, adv, mask = _one_token(1.25, 1.0)
    out = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert out.loss.item() == pytest.approx(-1.25)
    assert out.clip_fraction.item() == 0.0
    out.loss.backward()
    assert logp.grad.item() == pytest.approx(-1.25)  # d(−ρA)/dlogp = −ρA

    logp, old, adv, mask = _one_token(1.25, 1.0)
    out = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    assert out.loss.item() == pytest.approx(-1.2)
    assert out.clip_high_fraction.item() == 1.0 and out.clip_low_fraction.item() == 0.0
    out.loss.backward()
    assert logp.grad.item() == 0.0


def test_clip_low_with_negative_advantage():
    logp, old, adv, mask = _one_token(0.75, -1.0)
    out = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert out.loss.item() == pytest.approx(0.8)
    assert out.clip_low_fraction.item() == 1.0 and out.clip_fraction.item() == 1.0
    out.loss.backward()
    assert logp.grad.item() == 0.0
    # within [1 − ε_low, ...] nothing is clipped
    logp, old, adv, mask = _one_token(0.85, -1.0)
    out = policy_loss(logp, old, adv, mask)
    assert out.loss.item() == pytest.approx(0.85) and out.clip_fraction.item() == 0.0
    # A < 0 with a large ratio is never clipped (pessimistic bound keeps the gradient)
    logp, old, adv, mask = _one_token(1.5, -1.0)
    out = policy_loss(logp, old, adv, mask)
    assert out.loss.item() == pytest.approx(1.5) and out.clip_fraction.item() == 0.0
    out.loss.backward()
    assert logp.grad.item() == pytest.approx(1.5)


def test_policy_loss_matches_loop_reference_and_stats():
    g = torch.Generator().manual_seed(0)
    B, S = 4, 6
    old = -torch.rand(B, S, generator=g) * 3
    logp = (old + 0.4 * torch.randn(B, S, generator=g)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    mask = torch.rand(B, S, generator=g) > 0.3
    mask[:, 0] = True
    el, eh = 0.2, 0.28
    out = policy_loss(logp, old, adv, mask, eps_low=el, eps_high=eh, agg="token_mean")
    total, n, low, high, kl, ratios = 0.0, 0, 0, 0, 0.0, []
    for b in range(B):
        for j in range(S):
            if not mask[b, j]:
                continue
            r = math.exp(float(logp.detach()[b, j]) - float(old[b, j]))
            a = float(adv[b])
            total += -min(r * a, min(max(r, 1 - el), 1 + eh) * a)
            n += 1
            low += a < 0 and r < 1 - el
            high += a > 0 and r > 1 + eh
            kl += (r - 1) - math.log(r)
            ratios.append(r)
    assert out.loss.item() == pytest.approx(total / n, rel=1e-5)
    assert out.clip_low_fraction.item() == pytest.approx(low / n)
    assert out.clip_high_fraction.item() == pytest.approx(high / n)
    assert out.approx_kl.item() == pytest.approx(kl / n, rel=1e-4)
    assert out.ratio_max.item() == pytest.approx(max(ratios), rel=1e-5)
    assert out.ratio_min.item() == pytest.approx(min(ratios), rel=1e-5)
    assert out.ratio_mean.item() == pytest.approx(sum(ratios) / n, rel=1e-5)
    assert set(out.as_dict()) >= {"loss", "clip_fraction", "approx_kl", "ratio_mean"}


def test_on_policy_ratio_is_one_and_reinforce_gradient():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    ppo = policy_loss(logp, logp.detach(), adv, mask)
    assert ppo.ratio_mean.item() == 1.0 and ppo.approx_kl.item() == 0.0
    ppo.loss.backward()
    ppo_grad = logp.grad.clone()
    logp.grad = None
    rf = policy_loss(logp, None, adv, mask, kind="reinforce")
    # −A·logp, token mean over 5 tokens
    assert rf.loss.item() == pytest.approx(-(2 * (-3.5) + (-1) * (-1.0)) / 5)
    rf.loss.backward()
    expected = torch.tensor([[-2.0, -2.0, -2.0], [1.0, 1.0, 0.0]]) / 5
    torch.testing.assert_close(logp.grad, expected)
    torch.testing.assert_close(ppo_grad, expected)  # on-policy PPO gradient = REINFORCE gradient


def test_truncated_importance_sampling():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = logp.detach().clone()
    behaviour = old - torch.tensor([[math.log(3.0), math.log(0.5)]])  # exp(old − behaviour) = 3, 0.5
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(logp, old, torch.tensor([1.0]), mask, kind="reinforce", tis_cap=2.0, behaviour_logp=behaviour)
    # weights min(3, 2) = 2 and 0.5
    assert out.loss.item() == pytest.approx(-(2.0 * -1.0 + 0.5 * -2.0) / 2)
    assert out.tis_weight_mean.item() == pytest.approx(1.25)
    assert out.tis_capped_fraction.item() == 0.5
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.25]]))
    with pytest.raises(RlttError, match="behaviour_logp"):
        policy_loss(logp, old, torch.tensor([1.0]), mask, tis_cap=2.0)


def test_policy_loss_dr_grpo_aggregation_and_errors():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0])
    out = policy_loss(logp, None, adv, mask, kind="reinforce", agg="seq_mean_token_sum_norm", max_len=10)
    assert out.loss.item() == pytest.approx((6 / 10 + 4 / 10) / 2)
    with pytest.raises(RlttError, match="'ppo'"):
        policy_loss(logp, None, adv, mask, kind="ppo")
    with pytest.raises(RlttError, match="needs old_logp"):
        policy_loss(logp, None, adv, mask)
    with pytest.raises(RlttError, match="advantages shape"):
        policy_loss(logp, logp.detach(), torch.ones(3), mask)


def test_per_token_advantages_accepted():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = policy_loss(logp, None, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), kind="reinforce")
    assert out.loss.item() == pytest.approx((1.0 - 2.0) / 2)


# ---------------------------------------------------------------- KL


def test_kl_estimators_known_values():
    ref = torch.tensor([0.0, -1.0])
    logp = ref + torch.tensor([math.log(2.0), 0.0])
    d = math.log(2.0)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([d, 0.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5 * d * d, 0.0]))
    # k3 = exp(−d) + d − 1 = 0.5 + ln 2 − 1
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([d - 0.5, 0.0]))
    with pytest.raises(RlttError, match="'k4'"):
        kl_estimate(logp, ref, "k4")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=2, max_size=2))
def test_k2_k3_nonnegative(pair):
    logp, ref = torch.tensor(pair[:1], dtype=torch.float64), torch.tensor(pair[1:], dtype=torch.float64)
    assert kl_estimate(logp, ref, "k3").item() >= 0.0
    assert kl_estimate(logp, ref, "k2").item() >= 0.0


def test_k1_and_k3_are_unbiased_under_the_policy():
    # exact expectation over a small vocabulary of samples y ~ π
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    true_kl = float((pi * (pi.log() - ref.log())).sum())
    for kind in ("k1", "k3"):
        est = kl_estimate(pi.log(), ref.log(), kind)
        assert float((pi * est).sum()) == pytest.approx(true_kl, rel=1e-12)
    k2 = float((pi * kl_estimate(pi.log(), ref.log(), "k2")).sum())
    assert k2 != pytest.approx(true_kl, rel=1e-3)  # k2 is biased


def test_kl_in_loss_and_kl_in_reward():
    """The two KL forms the learner builds from `kl_estimate`: aggregated into the loss, and
    summed per sequence into the reward (`Learner.sequence_kl`)."""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -1.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    loss = 0.1 * aggregate(kl_estimate(logp, ref, "k1"), mask, "token_mean")
    # k1 per token: .5, 0, −1 | 0, 1 → token mean 0.5/5
    assert loss.item() == pytest.approx(0.1 * 0.5 / 5)
    loss.backward()
    torch.testing.assert_close(logp.grad, 0.1 * mask.float() / 5)
    per_sequence = (kl_estimate(logp.detach(), ref, "k1") * mask).sum(-1)  # the masked 7.0 never counts
    rewards = torch.tensor([1.0, 0.0])
    torch.testing.assert_close(rewards - 0.1 * per_sequence, torch.tensor([1.0 - 0.1 * (-0.5), 0.0 - 0.1 * 1.0]))
