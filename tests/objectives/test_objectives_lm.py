"""rltt.objectives.lm against the survival formula and hand computations."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.errors import RlttError
from rltt.objectives import (
    exit_distribution,
    exit_entropy,
    looped_lm_loss,
    smoothed_exit_loss,
    step_losses_from_logits,
    step_losses_from_logprobs,
)


def survival_reference(gates):
    """Naive loop over the survival formula, one position at a time (list of T floats)."""
    T = len(gates)
    probs = []
    for t in range(T):
        survive = 1.0
        for s in range(t):
            survive *= 1.0 - gates[s]
        probs.append(survive if t == T - 1 else gates[t] * survive)
    return probs


gate_value = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 1.0, 1e-12, 1.0 - 1e-12]))


@settings(max_examples=60, deadline=None)
@given(T=st.integers(1, 6), n=st.integers(1, 4), data=st.data())
def test_exit_distribution_matches_survival_formula(T, n, data):
    gates = [[data.draw(gate_value) for _ in range(n)] for _ in range(T)]
    lam = torch.tensor(gates, dtype=torch.float64)  # (T, n)
    p = exit_distribution(lam)
    assert p.shape == (T, n)
    for i in range(n):
        expected = survival_reference([gates[t][i] for t in range(T)])
        torch.testing.assert_close(p[:, i], torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p.sum(0), torch.ones(n, dtype=torch.float64), rtol=0, atol=1e-12)
    assert bool((p >= 0).all())


def test_exit_distribution_hand_values_and_unused_last_gate():
    lam = torch.tensor([0.5, 0.5, 0.9, 0.3])  # λ_T = 0.3 must not matter
    torch.testing.assert_close(exit_distribution(lam), torch.tensor([0.5, 0.25, 0.225, 0.025]))
    lam2 = lam.clone()
    lam2[-1] = 0.99
    assert torch.equal(exit_distribution(lam), exit_distribution(lam2))


def test_exit_distribution_single_loop_is_one():
    lam = torch.rand(1, 3, 5)
    assert torch.equal(exit_distribution(lam), torch.ones(1, 3, 5))


def test_exit_distribution_grad_finite_at_saturated_gates():
    lam = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.5, 0.5]], requires_grad=True)
    p = exit_distribution(lam)
    (p * torch.arange(3.0).unsqueeze(1)).sum().backward()
    assert torch.isfinite(lam.grad).all()
    # λ_1 = 1: p = (1, 0, 0); ∂p_2/∂λ_2 = 1 - λ_1 = 0, ∂p_3/∂λ_1 = -(1 - λ_2) = 0 and ∂p_2/∂λ_1 = -λ_2 = -1.
    assert lam.grad[0, 0].item() == pytest.approx(-1.0)


def test_exit_distribution_rejects_scalar():
    with pytest.raises(RlttError):
        exit_distribution(torch.tensor(0.5))


def test_exit_entropy_hand_values_and_zero_prob_gradient():
    p = torch.tensor([[0.5, 1.0], [0.5, 0.0]], requires_grad=True)
    h = exit_entropy(p)
    torch.testing.assert_close(h.detach(), torch.tensor([math.log(2.0), 0.0]))
    h.sum().backward()
    assert torch.isfinite(p.grad).all()


def _two_step_example():
    # T = 2, B = 1, S = 2
    L = torch.tensor([[[2.0, 4.0]], [[1.0, 3.0]]])
    p = torch.tensor([[[0.5, 0.25]], [[0.5, 0.75]]])
    return L, p


def test_looped_lm_loss_hand_values():
    L, p = _two_step_example()
    beta = 0.15
    h0 = math.log(2.0)
    h1 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    out = looped_lm_loss(L, p, beta=beta)
    tok0 = 0.5 * 2 + 0.5 * 1 - beta * h0
    tok1 = 0.25 * 4 + 0.75 * 3 - beta * h1
    assert out.loss.item() == pytest.approx((tok0 + tok1) / 2, rel=1e-6)
    assert out.expected_loss.item() == pytest.approx((1.5 + 3.25) / 2, rel=1e-6)
    torch.testing.assert_close(out.step_losses, torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(out.exit_probs, torch.tensor([0.375, 0.625]))
    assert out.mean_exit_step.item() == pytest.approx(1 * 0.375 + 2 * 0.625)
    assert out.exit_entropy.item() == pytest.approx((h0 + h1) / 2, rel=1e-6)
    assert out.num_tokens.item() == 2
    d = out.as_dict()
    assert d["exit_probs"] == pytest.approx([0.375, 0.625])


def test_looped_lm_loss_mask_drops_tokens():
    L, p = _two_step_example()
    out = looped_lm_loss(L, p, mask=torch.tensor([[True, False]]), beta=0.15)
    assert out.loss.item() == pytest.approx(1.5 - 0.15 * math.log(2.0), rel=1e-6)
    torch.testing.assert_close(out.step_losses, torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(out.exit_probs, torch.tensor([0.5, 0.5]))
    empty = looped_lm_loss(L, p, mask=torch.zeros(1, 2, dtype=torch.bool))
    assert empty.loss.item() == 0.0


def test_looped_lm_loss_gradients():
    L, p = _two_step_example()
    L = L.clone().requires_grad_(True)
    p = p.clone().requires_grad_(True)
    beta = 0.15
    looped_lm_loss(L, p, beta=beta).loss.backward()
    n = 2
    torch.testing.assert_close(L.grad, p.detach() / n)
    # ∂/∂p_t [p_t L_t + β p_t log p_t] = L_t + β (log p_t + 1)
    torch.testing.assert_close(p.grad, (L.detach() + beta * (torch.log(p.detach()) + 1)) / n)


def test_smoothed_exit_loss_hand_values():
    L, p = _two_step_example()
    eps, beta = 0.1, 0.15
    h0 = math.log(2.0)
    h1 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    tok0 = 0.9 * 1.5 + (0.1 / 2) * (2 + 1) - beta * h0
    tok1 = 0.9 * 3.25 + (0.1 / 2) * (4 + 3) - beta * h1
    out = smoothed_exit_loss(L, p, eps=eps, beta=beta)
    assert out.loss.item() == pytest.approx((tok0 + tok1) / 2, rel=1e-6)
    # telemetry uses the unsmoothed p
    torch.testing.assert_close(out.exit_probs, torch.tensor([0.375, 0.625]))
    assert out.expected_loss.item() == pytest.approx((1.5 + 3.25) / 2, rel=1e-6)


def test_smoothed_exit_loss_every_step_gets_at_least_eps_over_T():
    T, B, S = 3, 2, 4
    eps, beta = 0.05, 0.15
    torch.manual_seed(0)
    L = torch.rand(T, B, S).requires_grad_(True)
    # a collapsed gate: all mass on step 1 → steps 2, 3 get nothing from the plain loss
    p = torch.zeros(T, B, S)
    p[0] = 1.0
    n = B * S
    smoothed_exit_loss(L, p, eps=eps, beta=beta).loss.backward()
    expected = ((1 - eps) * p + eps / T) / n
    torch.testing.assert_close(L.grad, expected)
    assert bool((L.grad >= eps / T / n - 1e-12).all())
    L.grad = None
    looped_lm_loss(L, p, beta=beta).loss.backward()
    assert torch.equal(L.grad[1:], torch.zeros(T - 1, B, S))


def test_smoothed_exit_loss_gate_gradient_uses_unsmoothed_p():
    L, p = _two_step_example()
    p = p.clone().requires_grad_(True)
    eps, beta = 0.2, 0.15
    smoothed_exit_loss(L, p, eps=eps, beta=beta).loss.backward()
    torch.testing.assert_close(p.grad, ((1 - eps) * L + beta * (torch.log(p.detach()) + 1)) / 2)


def test_smoothed_with_zero_eps_equals_looped():
    torch.manual_seed(1)
    L = torch.rand(4, 2, 3)
    p = exit_distribution(torch.rand(4, 2, 3))
    mask = torch.rand(2, 3) > 0.3
    a = looped_lm_loss(L, p, mask, beta=0.1)
    b = smoothed_exit_loss(L, p, mask, eps=0.0, beta=0.1)
    assert torch.equal(a.loss, b.loss)


def test_lm_loss_input_errors():
    L, p = _two_step_example()
    with pytest.raises(RlttError, match="eps"):
        smoothed_exit_loss(L, p, eps=1.5)
    with pytest.raises(RlttError, match="exit_probs shape"):
        looped_lm_loss(L, p[:1])
    with pytest.raises(RlttError, match="mask shape"):
        looped_lm_loss(L, p, mask=torch.ones(2, 2))


def test_step_losses_helpers():
    torch.manual_seed(2)
    T, B, S, V = 3, 2, 4, 7
    logits = torch.randn(T, B, S, V)
    targets = torch.randint(0, V, (B, S))
    losses = step_losses_from_logits(logits, targets)
    for t in range(T):
        ref = F.cross_entropy(logits[t].reshape(-1, V), targets.reshape(-1), reduction="none").view(B, S)
        torch.testing.assert_close(losses[t], ref)
    lp = torch.log_softmax(logits, -1).gather(-1, targets.expand(T, B, S).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(step_losses_from_logprobs(lp), losses)
    with pytest.raises(RlttError):
        step_losses_from_logits(logits, targets[:, :2])
