"""A 16-bit rollout's kept set, as the learner's kernels decide it.

The native sampler takes the kept set of top-k/top-p from its LM head's 16-bit logits (``lm_head(h)``
in bf16, then fp32, `rltt.rollout.executor`): rounding makes ties at the boundary, which
``kept_floor`` keeps together. Given ``kept_dtype`` (the rollout's dtype) the learner's kernels
decide membership on their fp32 logits rounded the same way, so every kernel keeps exactly the
sampler's set. The set is read off the weight gradient of the log-probs alone: ``dLP/dz = onehot(y) −
p_K`` is non-zero exactly on the kept set, and each token's hidden state lives on its own block of
dimensions, so row i of the gradient's block j is non-zero iff token i is kept for token j.
"""

from __future__ import annotations

import pytest
import torch

from rltt.errors import RlttError
from rltt.kernels import per_loop_logprobs
from rltt.rollout import SamplingParams
from rltt.rollout.sampler import kept_floor, logprobs_of, sample

VOCAB, TOKENS, BLOCK = 32768, 4, 8  # V >= 32k, few tokens, a small hidden size (TOKENS * BLOCK)
SMALL_VOCAB = 2048  # Triton's interpreter at V = 32768 takes a minute a call: the fast tests use this
TEMPERATURE = 0.7
TRUNCATIONS = {"top_k": (20, 1.0), "top_p": (0, 0.8), "top_k+top_p": (20, 0.8)}


def rollout_step(dtype, top_k, top_p, seed=0, vocab=VOCAB):
    """Flat logits of a 16-bit head: hidden (1, N, d) with token j on dimensions j*BLOCK.., weight
    (V, d), the sampler's tokens and floors, its kept sets (N, V) and its tempered log-probs."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.zeros(1, TOKENS, TOKENS * BLOCK)
    for j in range(TOKENS):
        hidden[0, j, j * BLOCK:(j + 1) * BLOCK] = torch.randn(BLOCK, generator=gen)
    hidden = hidden.to(dtype)
    weight = (torch.randn(vocab, TOKENS * BLOCK, generator=gen) / BLOCK ** 0.5).to(dtype)
    logits = torch.nn.functional.linear(hidden[0], weight).float()  # what the executor's sampler sees
    params = SamplingParams(temperature=TEMPERATURE, top_k=top_k, top_p=top_p, max_new_tokens=1)
    uniforms = torch.rand(TOKENS, generator=gen, dtype=torch.float64)
    tokens, floors = sample(logits, params, uniforms)
    assert torch.equal(floors, kept_floor(logits / TEMPERATURE, params)) and bool((floors >= 0).all())
    scores = logits / TEMPERATURE
    kept = scores >= scores.gather(1, floors[:, None])
    _, tempered = logprobs_of(logits, tokens, TEMPERATURE, floors)
    return hidden, weight, tokens, floors, kept, tempered


def learner_kept(hidden, weight, tokens, floors, kept_dtype, impl):
    """(N, V) bool: each token's kept set as the kernel ``impl`` scores it, and its log-probs."""
    weight = weight.detach().clone().requires_grad_()
    lp = per_loop_logprobs(hidden, weight, tokens, temperature=TEMPERATURE, kept_floor=floors,
                           kept_dtype=kept_dtype, impl=impl).logprobs
    (grad,) = torch.autograd.grad(lp.sum(), [weight])
    blocks = grad.float().view(-1, TOKENS, BLOCK)
    return (blocks != 0).any(-1).T, lp.detach()[0]


CASES = [pytest.param(impl, truncation, VOCAB, id=f"{impl}-{truncation}")
         for impl in ("reference", "chunked") for truncation in TRUNCATIONS] + \
    [pytest.param("triton", truncation, SMALL_VOCAB, id=f"triton-{truncation}-V{SMALL_VOCAB}")
     for truncation in TRUNCATIONS] + \
    [pytest.param("triton", "top_k+top_p", VOCAB, id="triton-top_k+top_p", marks=pytest.mark.slow)]


@pytest.mark.parametrize("impl_name,truncation,vocab", CASES)
def test_the_learner_keeps_the_samplers_set_under_a_bf16_rollout(impl_name, truncation, vocab, monkeypatch):
    if impl_name == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    top_k, top_p = TRUNCATIONS[truncation]
    hidden, weight, tokens, floors, kept, tempered = rollout_step(torch.bfloat16, top_k, top_p, vocab=vocab)
    got, lp = learner_kept(hidden, weight, tokens, floors, torch.bfloat16, impl_name)
    for j in range(TOKENS):
        assert torch.equal(got[j], kept[j]), (j, int(got[j].sum()), int(kept[j].sum()))
    # the same set: the log-probs differ from the sampler's by the logits' rounding alone
    assert float((lp - tempered).abs().max()) < 0.03


def test_fp16_rollouts_are_rounded_to_fp16():
    for top_k, top_p in TRUNCATIONS.values():
        hidden, weight, tokens, floors, kept, _ = rollout_step(torch.float16, top_k, top_p, seed=1)
        for impl in ("reference", "chunked"):
            got, _ = learner_kept(hidden, weight, tokens, floors, torch.float16, impl)
            assert torch.equal(got, kept), (impl, top_k, top_p)


def test_fp32_and_none_are_the_fp32_kernels_bitwise(impl):
    """``kept_dtype`` fp32 is no rounding: the same numbers (values and gradients) as before it existed."""
    hidden, weight, tokens, floors, _, _ = rollout_step(torch.float32, 20, 0.8, vocab=SMALL_VOCAB)
    hidden = hidden.clone().requires_grad_()
    outs = []
    for kept_dtype in (None, torch.float32):
        w = weight.detach().clone().requires_grad_()
        lp, ent = per_loop_logprobs(hidden, w, tokens, temperature=TEMPERATURE, kept_floor=floors,
                                    kept_dtype=kept_dtype, impl=impl)
        outs.append((lp, ent, *torch.autograd.grad(lp.sum() + ent.sum(), [hidden, w])))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_kept_dtype_outside_the_table_is_a_one_line_error():
    hidden, weight, tokens, floors, _, _ = rollout_step(torch.float32, 20, 1.0, vocab=SMALL_VOCAB)
    with pytest.raises(RlttError, match="kept_dtype must be one of"):
        per_loop_logprobs(hidden, weight, tokens, kept_floor=floors, kept_dtype=torch.float64)
