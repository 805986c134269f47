"""Top-k/top-p: the kept set the sampler draws from, what it records, and what the engine samples.

The kept set is checked against the rule written out row by row: top-k keeps the scores at least
the k-th largest; top-p, on the top-k set renormalised, keeps (in descending order) the tokens whose
mass before them is below p; ties with the lowest kept score are kept. The recorded tempered
log-prob is ``s_y − log Σ_{i∈K} exp(s_i)`` (s = logits / temperature).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from rltt.rollout import NativeEngine, SamplingParams
from rltt.rollout.sampler import NO_FLOOR, kept_floor, logprobs_of, sample

from .helpers import dense_logprobs, prompts, tiny_model


def naive_kept(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(V,) bool: the kept set of one row by the rule above."""
    vocab = scores.shape[0]
    order = sorted(range(vocab), key=lambda i: -float(scores[i]))
    # top-k: the scores at least the k-th largest, ties at the boundary included (the set top-p
    # then renormalises over)
    kept = [i for i in order if float(scores[i]) >= float(scores[order[top_k - 1]])] if 0 < top_k < vocab else order
    if top_p < 1.0:
        values = torch.stack([scores[i] for i in kept])
        probs = torch.softmax(values, -1)
        before = probs.cumsum(-1) - probs
        kept = [i for i, b in zip(kept, before.tolist()) if b < top_p] or kept[:1]
    lowest = min(float(scores[i]) for i in kept)
    return scores >= lowest


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(2, 40), rows=st.integers(1, 5), top_k=st.integers(0, 45),
       top_p=st.sampled_from([1.0, 0.95, 0.7, 0.3, 0.05]), temperature=st.sampled_from([0.5, 1.0, 1.3]),
       scale=st.sampled_from([0.1, 2.0, 8.0]), seed=st.integers(0, 2**16), tie=st.booleans())
@example(vocab=22, rows=1, top_k=21, top_p=0.95, temperature=0.5, scale=0.1, seed=0, tie=True)  # a tie at the
# top-k boundary: top-p renormalises over both tied tokens
def test_the_kept_set_follows_the_rule_and_the_draws_stay_inside(vocab, rows, top_k, top_p, temperature, scale,
                                                                 seed, tie):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    if tie and vocab > 2:  # a tie at every rank: ties at the boundary are kept together
        logits[:, 1] = logits[:, 0]
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=1)
    scores = logits / temperature
    floor = kept_floor(scores, params)
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64)
    tokens, floor_sampled = sample(logits, params, uniforms)
    assert torch.equal(floor, floor_sampled)
    raw, tempered = logprobs_of(logits, tokens, temperature, floor)
    for r in range(rows):
        want = naive_kept(scores[r], top_k, top_p)
        f = int(floor[r])
        got = torch.ones(vocab, dtype=torch.bool) if f == NO_FLOOR else scores[r] >= scores[r, f]
        assert torch.equal(got, want), (r, f)
        assert (f == NO_FLOOR) == bool(want.all())
        assert bool(want[tokens[r]])  # never a token outside the kept set
        y = int(tokens[r])
        expect = scores[r, y] - torch.logsumexp(scores[r][want], 0)
        torch.testing.assert_close(tempered[r], expect, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(raw[r], torch.log_softmax(logits[r], -1)[y], atol=0, rtol=0)


def test_draws_follow_the_renormalised_truncated_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).expand(60_000, -1)
    u = torch.rand(60_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    params = SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=1)
    tokens, floor = sample(logits, params, u)
    kept = naive_kept(logits[0] / 0.7, 0, 0.8)
    want = torch.softmax((logits[0] / 0.7).double().masked_fill(~kept, float("-inf")), -1)
    freq = torch.bincount(tokens, minlength=5).double() / tokens.numel()
    assert float((freq - want).abs().max()) < 0.01
    _, tempered = logprobs_of(logits[:5], tokens[:5], 0.7, floor[:5])
    torch.testing.assert_close(tempered.double(), want[tokens[:5]].log(), atol=1e-6, rtol=1e-6)


def test_greedy_and_untruncated_record_no_floor():
    logits = torch.randn(4, 9)
    for params in (SamplingParams(temperature=0, top_k=2, max_new_tokens=1),
                   SamplingParams(temperature=1.0, top_k=9, max_new_tokens=1),
                   SamplingParams(temperature=1.0, max_new_tokens=1)):
        _, floor = sample(logits, params, torch.rand(4, dtype=torch.float64))
        assert (floor == NO_FLOOR).all()


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_the_engine_records_the_kept_set_the_learner_scores(schedule):
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(60)
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.9, max_new_tokens=8, n=3, seed=2,
                            exit_policy="sample", schedule=schedule)
    batch = NativeEngine(model).generate(prompts([3, 6]), params)
    mask = batch.completion_mask
    assert (batch.kept_floor[mask] >= 0).all() and (batch.kept_floor[~mask] == -1).all()
    with torch.no_grad():
        dense = dense_logprobs(model, batch, temperature=0.9, truncated=True)
        full = dense_logprobs(model, batch, temperature=0.9)
    assert (dense.exit - batch.tempered_logprobs)[mask].abs().max() < 1e-4
    assert ((dense.exit - full.exit)[mask] >= -1e-6).all()  # renormalised over a subset: never lower
