"""rltt.objectives.logprob against loop implementations of docs/design.md §5.3–5.4"""

import math

import pytest
import torch

from rltt.errors import RlttError
from rltt.objectives import exit_distribution, hybrid_logprob, loop_weights, policy_logprob

T, B, S = 4, 3, 5


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, B, S, 6, generator=g, dtype=torch.float64)
    LP = torch.log_softmax(logits, -1)[..., 0]  # log-prob of "token 0" at each step
    p = exit_distribution(torch.rand(T, B, S, generator=g, dtype=torch.float64))
    steps = torch.randint(1, T + 1, (B, S), generator=g)
    return LP, p, steps


def loop_reference(kind, LP, p, steps, weights=None):
    out = torch.zeros(B, S, dtype=LP.dtype)
    for b in range(B):
        for j in range(S):
            if kind == "exit":
                out[b, j] = LP[int(steps[b, j]) - 1, b, j]
            elif kind == "final":
                out[b, j] = LP[T - 1, b, j]
            elif kind == "mixture":
                out[b, j] = math.log(sum(float(p[t, b, j]) * math.exp(float(LP[t, b, j])) for t in range(T)))
            else:
                w = [float(p[t, b, j]) for t in range(T)] if weights is None else weights
                out[b, j] = sum(w[t] * float(LP[t, b, j]) for t in range(T))
    return out


@pytest.mark.parametrize("kind", ["exit", "final", "mixture", "rltt"])
def test_policy_logprob_matches_loop(kind):
    LP, p, steps = _inputs()
    got = policy_logprob(kind, LP, exit_probs=p, exit_steps=steps)
    torch.testing.assert_close(got, loop_reference(kind, LP, p, steps))


def test_exit_picks_the_recorded_step():
    # LP[t] = -(t+1) everywhere: the chosen value names the step
    LP = -torch.arange(1, T + 1, dtype=torch.float32).view(T, 1, 1).expand(T, B, S).clone()
    steps = torch.tensor([[1, 2, 3, 4, 1], [4, 4, 4, 4, 4], [2, 1, 3, 2, 1]])
    got = policy_logprob("exit", LP, exit_steps=steps)
    assert torch.equal(got, -steps.float())


def test_exit_gradient_only_reaches_the_recorded_step():
    LP, _, steps = _inputs(1)
    LP = LP.clone().requires_grad_(True)
    policy_logprob("exit", LP, exit_steps=steps).sum().backward()
    expected = torch.zeros_like(LP)
    for b in range(B):
        for j in range(S):
            expected[int(steps[b, j]) - 1, b, j] = 1.0
    assert torch.equal(LP.grad, expected)


def test_exit_steps_validation_and_mask():
    LP, _, steps = _inputs()
    bad = steps.clone()
    bad[1, 2] = 0
    with pytest.raises(RlttError, match="exit step 0"):
        policy_logprob("exit", LP, exit_steps=bad)
    bad[1, 2] = T + 1
    with pytest.raises(RlttError, match=f"exit step {T + 1}"):
        policy_logprob("exit", LP, exit_steps=bad)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 2] = False  # padding: any recorded value is ignored, output 0 there
    got = policy_logprob("exit", LP, exit_steps=bad, mask=mask)
    assert got[1, 2].item() == 0.0
    ref = loop_reference("exit", LP, None, torch.where(mask, bad, torch.ones_like(bad)))
    torch.testing.assert_close(got[mask], ref[mask])
    with pytest.raises(RlttError, match="needs the recorded exit_steps"):
        policy_logprob("exit", LP)
    with pytest.raises(RlttError, match="integer"):
        policy_logprob("exit", LP, exit_steps=steps.float())


@pytest.mark.parametrize("omega", ["uniform", "progressive"])
def test_rltt_fixed_weights_match_loop(omega):
    LP, p, steps = _inputs(2)
    alpha = 2.0
    if omega == "uniform":
        w = [1.0 / T] * T
    else:
        raw = [(t + 1) ** alpha for t in range(T)]
        w = [x / sum(raw) for x in raw]
    got = policy_logprob("rltt", LP, exit_probs=p, omega=omega, alpha=alpha)
    torch.testing.assert_close(got, loop_reference("rltt", LP, p, steps, weights=w))


def test_progressive_weights_normalised():
    w = loop_weights("progressive", 3, alpha=2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 4.0, 9.0]) / 14.0)
    for alpha in (0.0, 0.5, 1.0, 3.0):
        assert loop_weights("progressive", 5, alpha=alpha).sum().item() == pytest.approx(1.0)
    torch.testing.assert_close(loop_weights("progressive", 4, alpha=0.0), loop_weights("uniform", 4))
    # increasing in t for alpha > 0
    w = loop_weights("progressive", 4, alpha=1.0)
    assert bool((w[1:] > w[:-1]).all())


def test_exit_pdf_weights_detached_by_default():
    LP, p, _ = _inputs(3)
    p = p.clone().requires_grad_(True)
    LP = LP.clone().requires_grad_(True)
    out = policy_logprob("rltt", LP, exit_probs=p, omega="exit_pdf")
    out.sum().backward()
    assert p.grad is None
    torch.testing.assert_close(LP.grad, p.detach())
    LP.grad = None
    policy_logprob("rltt", LP, exit_probs=p, omega="exit_pdf", detach_weights=False).sum().backward()
    torch.testing.assert_close(p.grad, LP.detach())


def test_learned_omega_gets_gradient():
    LP, _, _ = _inputs(4)
    logits = torch.tensor([0.3, -0.2, 0.1, 0.5], dtype=torch.float64, requires_grad=True)
    out = policy_logprob("rltt", LP, omega="learned", learned_logits=logits)
    w = torch.softmax(logits.detach(), 0)
    torch.testing.assert_close(out, (w.view(T, 1, 1) * LP).sum(0))
    out.sum().backward()
    # d/dz Σ_t softmax(z)_t c_t = ω ⊙ (c − ω·c), with c_t = Σ_{b,j} LP_t
    c = LP.sum(dim=(1, 2))
    torch.testing.assert_close(logits.grad, w * (c - (w * c).sum()))
    assert logits.grad.abs().sum() > 0
    with pytest.raises(RlttError, match="learned_logits"):
        policy_logprob("rltt", LP, omega="learned")
    with pytest.raises(RlttError, match=r"expected shape \(4,\)"):
        policy_logprob("rltt", LP, omega="learned", learned_logits=torch.zeros(3))


def test_mixture_with_zero_exit_probs_has_finite_gradient():
    LP, _, _ = _inputs(5)
    p = torch.zeros(T, B, S, dtype=torch.float64)
    p[1] = 1.0
    p.requires_grad_(True)
    LP = LP.clone().requires_grad_(True)
    out = policy_logprob("mixture", LP, exit_probs=p)
    torch.testing.assert_close(out, LP.detach()[1])  # all mass on step 2
    out.sum().backward()
    assert torch.isfinite(p.grad).all() and torch.isfinite(LP.grad).all()


def test_bad_kind_and_omega_raise_rltt_error_naming_the_value():
    LP, p, _ = _inputs()
    with pytest.raises(RlttError, match="'argmax'"):
        policy_logprob("argmax", LP, exit_probs=p)
    with pytest.raises(RlttError, match="'cosine'"):
        policy_logprob("rltt", LP, exit_probs=p, omega="cosine")
    with pytest.raises(RlttError, match="needs exit_probs"):
        policy_logprob("mixture", LP)
    with pytest.raises(RlttError, match="needs exit_probs"):
        policy_logprob("rltt", LP, omega="exit_pdf")
    with pytest.raises(RlttError, match="exit_probs shape"):
        policy_logprob("mixture", LP, exit_probs=p[:2])


def _dense_logp(weight, x, y):
    """A tiny 'policy': log-softmax(x Wᵀ) at targets y, per token (B, S)."""
    return torch.log_softmax(x @ weight.T, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


def test_hybrid_logprob_value_is_rollout_exactly_and_gradient_is_dense():
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(7, 4, generator=g, requires_grad=True)
    x = torch.randn(B, S, 4, generator=g)
    y = torch.randint(0, 7, (B, S), generator=g)
    dense_at_rollout = _dense_logp(weight, x, y).detach()
    # the sampler's log-prob differs from the learner's by engine numerics
    rollout = dense_at_rollout + 1e-3 * torch.randn(B, S, generator=g)

    for anchor in (dense_at_rollout, None):
        logp = hybrid_logprob(_dense_logp(weight, x, y), rollout, anchor)
        assert torch.equal(logp, rollout)  # bit for bit: importance ratio exactly 1
        weight.grad = None
        (logp * torch.linspace(-1, 1, S)).sum().backward()
        hybrid_grad = weight.grad.clone()
        weight.grad = None
        (_dense_logp(weight, x, y) * torch.linspace(-1, 1, S)).sum().backward()
        assert torch.equal(hybrid_grad, weight.grad)

    # after an update the hybrid moves with the dense log-prob from the rollout value
    with torch.no_grad():
        weight.add_(0.1)
    moved = hybrid_logprob(_dense_logp(weight, x, y), rollout, dense_at_rollout)
    torch.testing.assert_close(moved, rollout + (_dense_logp(weight, x, y).detach() - dense_at_rollout))


def test_hybrid_logprob_keeps_fp32_rollout_under_bf16_dense():
    rollout = torch.tensor([-0.123456789, -2.0000001])
    dense = torch.tensor([-0.125, -2.0], dtype=torch.bfloat16, requires_grad=True)
    out = hybrid_logprob(dense, rollout)
    assert out.dtype == torch.float32 and torch.equal(out, rollout)
    with pytest.raises(RlttError, match="shape"):
        hybrid_logprob(dense, rollout[:1])


def test_hybrid_logprob_exact_even_for_large_mismatch():
    # the naive d + (r − d) rounds for these values; the hybrid must still return r bit for bit
    dense = torch.tensor([-20.123, -7.77, -3.3], requires_grad=True)
    rollout = torch.tensor([-1.234e-4, -1e-7, -0.1])
    assert not torch.equal(dense.detach() + (rollout - dense.detach()), rollout)
    out = hybrid_logprob(dense, rollout, dense.detach().clone())
    assert torch.equal(out, rollout)
    out.sum().backward()
    assert torch.equal(dense.grad, torch.ones(3))
