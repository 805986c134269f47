"""Truncated per-loop log-probs (top-k/top-p kept sets) and fp32 states on a 16-bit head weight.

Each kernel is checked against a naive formula written out here, values and gradients: for row
(t, j) with tempered logits z = h_t,j · Wᵀ / τ and kept-set floor f = kept_floor[j] ≥ 0,

    K = {i : z_i ≥ z_f} ∪ {f, y_j},     LP = z_y − log Σ_{i∈K} exp(z_i),

and LP = log_softmax(z)_y for f = −1; the entropy is always the full distribution's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from rltt.errors import RlttError
from rltt.kernels import per_loop_logprobs

from .helpers import make_inputs, upstream, values_and_grads


def naive(hidden, weight, targets, floors, temperature=1.0):
    """The formula above, row by row, on materialised fp32 logits (differentiable)."""
    steps, n, _ = hidden.shape
    lps, ents = [], []
    for t in range(steps):
        lp_row, ent_row = [], []
        for j in range(n):
            z = (hidden[t, j].float() @ weight.float().T) / temperature
            y, f = int(targets[j]), int(floors[j])
            p = torch.softmax(z, -1)
            ent_row.append(-(p * torch.log_softmax(z, -1)).sum())
            if f < 0:
                lp_row.append(torch.log_softmax(z, -1)[y])
                continue
            keep = z.detach() >= z.detach()[f]
            keep[f] = keep[y] = True
            lp_row.append(z[y] - torch.logsumexp(z[keep], 0))
        lps.append(torch.stack(lp_row))
        ents.append(torch.stack(ent_row))
    return torch.stack(lps), torch.stack(ents)


def random_floors(n, vocab, seed, none_share=0.3):
    gen = torch.Generator().manual_seed(seed)
    floors = torch.randint(0, vocab, (n,), generator=gen)
    return torch.where(torch.rand(n, generator=gen) < none_share, torch.full_like(floors, -1), floors)


def _check(impl, steps, n, d, vocab, temperature, chunk, seed, masked=False):
    hidden, weight, targets = make_inputs(steps, n, d, vocab, seed=seed, scale=2.0)
    floors = random_floors(n, vocab, seed + 7)
    grads = upstream(steps, n, seed=seed + 1)
    mask = None
    if masked:
        mask = torch.rand(n, generator=torch.Generator().manual_seed(seed + 3)) > 0.3
        grads = tuple(g * mask for g in grads)

    class Out:
        def __init__(self, lp, ent):
            self.logprobs, self.entropy = lp, ent

    def want():
        lp, ent = naive(hidden, weight, targets, floors, temperature)
        if mask is not None:
            lp, ent = lp * mask, ent * mask
        return Out(lp, ent)

    ref = values_and_grads(want, hidden, weight, grads)
    got = values_and_grads(lambda: per_loop_logprobs(hidden, weight, targets, temperature=temperature, mask=mask,
                                                     kept_floor=floors, chunk_size=chunk, impl=impl),
                           hidden, weight, grads)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("impl_name", ["reference", "chunked", "triton"])
@pytest.mark.parametrize("temperature,masked", [(1.0, False), (0.7, True)])
def test_truncated_logprobs_match_the_formula(impl_name, temperature, masked, monkeypatch):
    if impl_name == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check(impl_name, steps=3, n=6, d=12, vocab=70, temperature=temperature, chunk=32, seed=4, masked=masked)


@settings(max_examples=25, deadline=None)
@given(steps=st.integers(1, 3), n=st.integers(1, 6), d=st.integers(1, 12), vocab=st.integers(2, 80),
       chunk=st.integers(1, 48), temperature=st.sampled_from([0.5, 1.0, 1.7]), seed=st.integers(0, 2**16),
       masked=st.booleans())
def test_chunked_truncation_matches_the_formula_on_random_shapes(steps, n, d, vocab, chunk, temperature, seed,
                                                                 masked):
    _check("chunked", steps, n, d, vocab, temperature, chunk, seed, masked)


# the interpreter switch is set once for all draws
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.integers(1, 2), n=st.integers(1, 5), d=st.integers(1, 20), vocab=st.integers(2, 90),
       seed=st.integers(0, 2**16))
def test_triton_truncation_matches_the_formula_on_random_shapes(steps, n, d, vocab, seed, triton_interpret):
    _check("triton", steps, n, d, vocab, 1.0, 32, seed)


def test_the_kept_set_raises_the_log_prob_and_the_floor_token_alone_keeps_two(impl):
    hidden, weight, targets = make_inputs(2, 5, 8, 40, seed=1, scale=3.0)
    full = per_loop_logprobs(hidden, weight, targets, impl=impl).logprobs
    z = (hidden.detach() @ weight.detach().T)
    # the floor = each token's own target: at a loop ranking the target first the kept set is {y}: LP = 0
    top = z[0].argmax(-1)
    lp = per_loop_logprobs(hidden, weight, top, kept_floor=top, impl=impl).logprobs
    assert torch.allclose(lp[0], torch.zeros(5), atol=1e-6)
    floors = z[1].argsort(-1, descending=True)[:, 3]  # loop 2's top 4
    lp = per_loop_logprobs(hidden, weight, targets, kept_floor=floors, impl=impl).logprobs
    assert (lp >= full - 1e-6).all()
    kept = z[1] >= z[1].gather(1, floors[:, None])
    kept[torch.arange(5), targets] = True
    want = z[1].gather(1, targets[:, None])[:, 0] - torch.logsumexp(z[1].masked_fill(~kept, float("-inf")), -1)
    torch.testing.assert_close(lp[1], want, atol=1e-5, rtol=1e-5)


def test_no_floor_is_the_untruncated_kernel_bitwise(impl):
    hidden, weight, targets = make_inputs(3, 7, 16, 100, seed=2)
    grads = upstream(3, 7)
    plain = values_and_grads(lambda: per_loop_logprobs(hidden, weight, targets, impl=impl, chunk_size=32),
                             hidden, weight, grads)
    none = values_and_grads(lambda: per_loop_logprobs(hidden, weight, targets, impl=impl, chunk_size=32,
                                                      kept_floor=torch.full((7,), -1)), hidden, weight, grads)
    for a, b in zip(plain, none):
        assert torch.equal(a, b)


def test_bad_floors_are_one_line_errors():
    hidden, weight, targets = make_inputs(1, 3, 4, 10)
    with pytest.raises(RlttError, match="kept_floor must be integer"):
        per_loop_logprobs(hidden, weight, targets, kept_floor=torch.zeros(3))
    with pytest.raises(RlttError, match="kept_floor must be integer of shape"):
        per_loop_logprobs(hidden, weight, targets, kept_floor=torch.zeros(4, dtype=torch.long))
    with pytest.raises(RlttError, match="outside the vocabulary"):
        per_loop_logprobs(hidden, weight, targets, kept_floor=torch.tensor([0, 10, -1]))


@pytest.mark.parametrize("truncated", [False, True])
def test_fp32_states_on_a_bf16_weight_are_the_upcast_computation(impl, truncated):
    """An fp32 LM head on a bf16 model: fp32 states, the bf16 weight upcast inside the kernel, the
    weight's gradient in bf16 — the same numbers as an fp32 copy of the weight."""
    hidden, weight, targets = make_inputs(2, 6, 16, 90, seed=3, scale=2.0)
    weight16 = weight.detach().bfloat16().requires_grad_()
    weight32 = weight16.detach().float().requires_grad_()
    floors = random_floors(6, 90, 5) if truncated else None
    grads = upstream(2, 6)
    mixed = values_and_grads(lambda: per_loop_logprobs(hidden, weight16, targets, kept_floor=floors, impl=impl,
                                                       chunk_size=32), hidden, weight16, grads)
    upcast = values_and_grads(lambda: per_loop_logprobs(hidden, weight32, targets, kept_floor=floors, impl=impl,
                                                        chunk_size=32), hidden, weight32, grads)
    assert mixed[3].dtype == torch.bfloat16 and mixed[2].dtype == torch.float32
    for a, b in zip(mixed[:3], upcast[:3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[3].float(), upcast[3].bfloat16().float(), atol=1e-2, rtol=1e-2)
