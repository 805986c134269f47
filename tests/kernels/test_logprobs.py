"""Chunked and Triton (interpreter) log-probs against the naive reference."""

from __future__ import annotations

import pytest
import torch

from rltt.kernels import LoopLogProbs, per_loop_logprobs
from rltt.kernels.reference import reference_logprobs

from .helpers import make_inputs, upstream, values_and_grads

# (atol, rtol) for values; gradients are compared relative to their largest entry
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
# bf16 inputs: values are fp32 from bf16 operands, so as tight as fp32; gradients come back
# in bf16 (relative rounding 2**-8) and Triton also rounds the logit gradient to bf16 for
# its GEMMs, so 2e-2 of the gradient's scale.
BF16_GRAD_TOL = 2e-2

def check(impl, hidden, weight, targets, *, grad_tol=1e-5, value_tol=FP32_TOL, **kwargs):
    grads = upstream(hidden.shape[0], hidden.shape[1])
    ref = values_and_grads(lambda: reference_logprobs(hidden, weight, targets, **{
        k: v for k, v in kwargs.items() if k in ("temperature", "mask")}), hidden, weight, grads)
    got = values_and_grads(lambda: per_loop_logprobs(hidden, weight, targets, impl=impl, **kwargs),
                           hidden, weight, grads)
    torch.testing.assert_close(got[0], ref[0], **value_tol, msg="logprobs")
    torch.testing.assert_close(got[1], ref[1], **value_tol, msg="entropy")
    for name, g, r in (("grad hidden", got[2], ref[2]), ("grad weight", got[3], ref[3])):
        assert g.dtype == r.dtype, name
        scale = r.float().abs().max().clamp_min(1e-6)
        err = (g.float() - r.float()).abs().max() / scale
        assert err <= grad_tol, f"{name}: relative error {err:.2e} > {grad_tol:.0e}"
    return got


def test_fp32_matches_reference(impl):
    hidden, weight, targets = make_inputs(3, 7, 32, 96)
    check(impl, hidden, weight, targets, chunk_size=32)


def test_vocab_not_multiple_of_chunk(impl):
    hidden, weight, targets = make_inputs(2, 6, 24, 101)
    targets[-1] = 100  # target in the ragged last chunk
    check(impl, hidden, weight, targets, chunk_size=40)


def test_temperature(impl):
    hidden, weight, targets = make_inputs(2, 5, 16, 70, scale=3.0)
    check(impl, hidden, weight, targets, temperature=0.6, chunk_size=32)
    check(impl, hidden, weight, targets, temperature=1.7, chunk_size=32)


def test_single_step(impl):
    hidden, weight, targets = make_inputs(1, 9, 16, 64)
    lp, ent, _, _ = check(impl, hidden, weight, targets, chunk_size=16)
    assert lp.shape == ent.shape == (1, 9)


def test_masked_positions(impl):
    hidden, weight, targets = make_inputs(3, 8, 16, 50)
    mask = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    targets[~mask] = -100  # padding ids must not matter
    lp, ent, gh, _ = check(impl, hidden, weight, targets, mask=mask, chunk_size=32)
    assert (lp[:, ~mask] == 0).all() and (ent[:, ~mask] == 0).all()
    assert (gh[:, ~mask] == 0).all()
    assert (gh[:, mask] != 0).any()


def test_all_masked(impl):
    hidden, weight, targets = make_inputs(2, 3, 16, 40)
    out = per_loop_logprobs(hidden, weight, targets, mask=torch.zeros(3, dtype=torch.bool), impl=impl)
    assert out.logprobs.shape == (2, 3) and (out.logprobs == 0).all() and (out.entropy == 0).all()
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert (hidden.grad == 0).all() and (weight.grad == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_inputs(impl, dtype):
    hidden, weight, targets = make_inputs(2, 6, 32, 80, dtype=dtype)
    lp, ent, gh, gw = check(impl, hidden, weight, targets, chunk_size=32,
                            grad_tol=BF16_GRAD_TOL, value_tol=dict(atol=1e-4, rtol=1e-4))
    assert lp.dtype == ent.dtype == torch.float32
    assert gh.dtype == gw.dtype == dtype


def test_only_one_output_used(impl):
    """Gradients flow when only logprobs (or only entropy) feed the loss."""
    hidden, weight, targets = make_inputs(2, 4, 16, 48)
    ref = reference_logprobs(hidden, weight, targets)
    out = per_loop_logprobs(hidden, weight, targets, impl=impl, chunk_size=16)
    for got, want in ((out.logprobs, ref.logprobs), (out.entropy, ref.entropy)):
        g = torch.autograd.grad(got.sum(), [hidden, weight], retain_graph=True)
        r = torch.autograd.grad(want.sum(), [hidden, weight], retain_graph=True)
        for a, b in zip(g, r):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_extreme_logits_stay_finite(impl):
    """Large logit ranges: the online logsumexp must not overflow."""
    hidden, weight, targets = make_inputs(2, 5, 16, 64, scale=40.0)
    lp, ent, gh, gw = check(impl, hidden, weight, targets, chunk_size=16,
                            value_tol=dict(atol=1e-4, rtol=1e-5))
    assert torch.isfinite(lp).all() and torch.isfinite(gh).all() and torch.isfinite(gw).all()


def test_result_unpacks_like_a_tuple():
    hidden, weight, targets = make_inputs(1, 3, 8, 20)
    out = per_loop_logprobs(hidden, weight, targets)
    assert isinstance(out, LoopLogProbs)
    lp, ent = out
    assert lp is out.logprobs and ent is out.entropy


def test_triton_forward_split_merge(triton_interpret):
    """Several vocabulary splits per row block are merged exactly."""
    from rltt.kernels.triton_logprobs import triton_forward

    hidden, weight, targets = make_inputs(1, 20, 16, 200)
    rows = hidden.detach()[0]
    ref = reference_logprobs(hidden.detach(), weight.detach(), targets)
    for splits in (1, 3, 7):
        lp, _, ent = triton_forward(rows, weight.detach(), targets, 1.0, splits=splits)
        torch.testing.assert_close(lp, ref.logprobs[0], **FP32_TOL)
        torch.testing.assert_close(ent, ref.entropy[0], **FP32_TOL)


def test_loops_without_upstream_gradient_match_the_reference(impl):
    """A final-loop loss gives loops 1..T-1 zero gradient: the backward skips their rows exactly."""
    hidden, weight, targets = make_inputs(3, 7, 32, 96)
    results = []
    for fn in (lambda h, w: reference_logprobs(h, w, targets, temperature=0.8),
               lambda h, w: per_loop_logprobs(h, w, targets, temperature=0.8, impl=impl, chunk_size=32)):
        h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
        out = fn(h, w)
        (out.logprobs[-1] * torch.linspace(0.5, 1.5, 7)).sum().backward()  # only the last loop's log-probs
        results.append((h.grad, w.grad))
    (gh, gw), (rh, rw) = results[1], results[0]
    assert torch.equal(gh[:-1], torch.zeros_like(gh[:-1]))
    torch.testing.assert_close(gh, rh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-5)
