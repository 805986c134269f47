"""Hypothesis over small shapes: chunked (and Triton on a few draws) vs the reference."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from rltt.kernels import per_loop_logprobs
from rltt.kernels.reference import reference_logprobs

from .helpers import upstream, values_and_grads

shapes = st.fixed_dictionaries(dict(
    steps=st.integers(1, 4), n=st.integers(1, 9), d=st.integers(1, 24), vocab=st.integers(2, 130),
    chunk=st.integers(1, 64), temperature=st.sampled_from([0.5, 1.0, 2.0]),
    masked=st.booleans(), seed=st.integers(0, 2**16)))


def _compare(impl, case):
    gen = torch.Generator().manual_seed(case["seed"])
    steps, n, d, vocab = case["steps"], case["n"], case["d"], case["vocab"]
    hidden = torch.randn(steps, n, d, generator=gen).requires_grad_()
    weight = torch.randn(vocab, d, generator=gen).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=gen)
    mask = torch.rand(n, generator=gen) > 0.4 if case["masked"] else None
    kwargs = dict(temperature=case["temperature"], mask=mask)
    grads = upstream(steps, n, seed=case["seed"] + 1)
    ref = values_and_grads(lambda: reference_logprobs(hidden, weight, targets, **kwargs),
                           hidden, weight, grads)
    got = values_and_grads(lambda: per_loop_logprobs(hidden, weight, targets, impl=impl,
                                                     chunk_size=case["chunk"], **kwargs),
                           hidden, weight, grads)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@settings(max_examples=60, deadline=None)
@given(case=shapes)
def test_chunked_matches_reference(case):
    _compare("chunked", case)


# the interpreter switch is set once for all draws, which is what we want here
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=shapes)
def test_triton_matches_reference(case, triton_interpret):
    _compare("triton", case)
