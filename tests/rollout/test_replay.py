"""Bitwise replay of recorded passes, and the hybrid log-prob at the rollout's weights."""

import pytest
import torch

from rltt.objectives import hybrid_logprob
from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs

from .helpers import dense_logprobs, prompts, tiny_model


SHAPES = [
    ([5], 1, "threshold:0.6"),
    ([1, 9, 4], 1, "sample"),
    ([3, 3], 3, "threshold:0.4"),
    ([7, 2, 5, 1, 6], 2, "fixed:2"),
]
CASES = [(torch.float32, s, *shape) for s in ("dense", "deferred") for shape in SHAPES] + \
    [(torch.bfloat16, s, *shape) for s in ("dense", "deferred") for shape in SHAPES[1:3]]


@pytest.mark.parametrize("dtype,schedule,sizes,n,policy", CASES)
def test_replay_is_bitwise(dtype, schedule, sizes, n, policy):
    model = tiny_model(dtype=dtype, injection="scalar", lora_rank=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, max_new_tokens=9, n=n, seed=11,
                            exit_policy=policy, schedule=schedule)
    batch = NativeEngine(model).generate(prompts(sizes, seed=len(sizes)), params)
    assert batch.dtype == dtype
    replay = replay_logprobs(model, batch)
    assert torch.equal(replay.logprobs, batch.logprobs)
    assert torch.equal(replay.tempered_logprobs, batch.tempered_logprobs)
    assert not torch.equal(batch.logprobs, batch.tempered_logprobs)
    assert (batch.logprobs[batch.completion_mask] < 0).all()


def test_replay_with_new_weights_differs_and_same_seed_reproduces():
    model = tiny_model()
    engine = NativeEngine(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3, exit_policy="sample")
    batch = engine.generate(prompts([4, 6]), params)
    again = engine.generate(prompts([4, 6]), params)
    assert torch.equal(batch.completion_ids, again.completion_ids)
    assert torch.equal(batch.exit_steps, again.exit_steps)
    assert torch.equal(batch.logprobs, again.logprobs)
    other_seed = engine.generate(prompts([4, 6]), SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=4,
                                                                 exit_policy="sample"))
    assert not torch.equal(batch.completion_ids, other_seed.completion_ids)

    learner = tiny_model()
    with torch.no_grad():
        learner.lm_head.weight.add_(0.01)
    moved = replay_logprobs(learner, batch).logprobs
    assert not torch.equal(moved, batch.logprobs)
    engine.load_weights(1, learner.state_dict())  # weight hand-off: the engine now replays the learner's policy
    assert engine.weights_version == 1
    assert torch.equal(replay_logprobs(engine.model, batch).logprobs, moved)


def test_seed_none_is_recorded_and_reproducible():
    engine = NativeEngine(tiny_model())
    batch = engine.generate(prompts([3]), SamplingParams(max_new_tokens=6, exit_policy="sample"))
    assert isinstance(batch.params.seed, int)
    again = engine.generate(prompts([3]), batch.params)
    assert torch.equal(batch.completion_ids, again.completion_ids)


def test_hybrid_logprob_is_the_sampler_value_with_the_dense_gradient():
    model = tiny_model()
    batch = NativeEngine(model).generate(prompts([5, 2]), SamplingParams(max_new_tokens=7, seed=0,
                                                                         exit_policy="threshold:0.5"))
    dense = dense_logprobs(model, batch)
    hybrid = hybrid_logprob(dense.exit, batch.logprobs).masked_fill(~batch.completion_mask, 0.0)
    assert torch.equal(hybrid.detach(), batch.logprobs)  # importance ratio exactly 1
    assert (dense.exit.detach() - batch.logprobs).abs().max() < 1e-4
    hybrid[batch.completion_mask].sum().backward()
    grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    dense_logprobs(model, batch).exit[batch.completion_mask].sum().backward()
    assert torch.equal(grad, model.lm_head.weight.grad)


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
@pytest.mark.parametrize("top_p,top_k", [(0.7, 0), (1.0, 5), (0.8, 7)])
def test_hybrid_ratio_is_exactly_one_under_top_p_and_top_k(schedule, top_p, top_k):
    """Truncated sampling: the sampler records the log-prob of the truncated, renormalised
    distribution, the learner scores the same kept set, so the hybrid value is the sampler's bit for
    bit (ratio exactly 1), the dense value is rounding away from it, and the gradient is the dense
    truncated one."""
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(60)  # peaked logits: truncation drops real mass
    params = SamplingParams(temperature=0.8, top_p=top_p, top_k=top_k, max_new_tokens=7, n=2, seed=5,
                            exit_policy="sample", schedule=schedule)
    batch = NativeEngine(model).generate(prompts([5, 2, 4]), params)
    cmask = batch.completion_mask
    assert (batch.kept_floor[cmask] >= 0).any()
    dense = dense_logprobs(model, batch, temperature=0.8, truncated=True)
    hybrid = hybrid_logprob(dense.exit, batch.tempered_logprobs).masked_fill(~cmask, 0.0)
    assert torch.equal(hybrid.detach(), batch.tempered_logprobs)  # importance ratio exactly 1
    assert (dense.exit.detach() - batch.tempered_logprobs)[cmask].abs().max() < 1e-4
    untruncated = dense_logprobs(model, batch, temperature=0.8).exit.detach()
    assert (untruncated - batch.tempered_logprobs)[cmask].abs().max() > 1e-2  # what scoring the full support misses
    hybrid[cmask].sum().backward()
    grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    dense_logprobs(model, batch, temperature=0.8, truncated=True).exit[cmask].sum().backward()
    assert torch.equal(grad, model.lm_head.weight.grad)
