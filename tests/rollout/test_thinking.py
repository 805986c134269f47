"""Thinking budget with a forced answer: where the interruption goes, its mask, bitwise replay,
and that forced tokens are input but never policy actions in the learner."""

from dataclasses import replace

import pytest
import torch

from rltt.errors import RlttError
from rltt.learner.learner_batch import LearnerBatch
from rltt.learner.settings import AlgorithmConfig
from rltt.learner.loss import rl_loss
from rltt.learner.scoring import score_tokens
from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs
from rltt.rollout.params import ThinkingBudget

from .helpers import assert_forced_at_budget, dense_logprobs, prompts, tiny_model

CLOSE = [59, 60]  # a two-token close marker: no row samples it within a 4-token budget
INTERRUPTION = [5, 6, 7, *CLOSE]
BUDGET, ANSWER = 4, 3


def thinking(budget=BUDGET, close=CLOSE, answer=ANSWER):
    return ThinkingBudget(budget=budget, close=list(close), interruption=list(INTERRUPTION), answer_budget=answer)


def params(schedule="deferred", policy="sample", n=2, seed=5, **kw):
    return SamplingParams(temperature=1.0, max_new_tokens=BUDGET, n=n, seed=seed, exit_policy=policy,
                          schedule=schedule, ignore_eos=True, thinking=thinking(**kw))


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_every_row_forced_holds_the_interruption_then_its_answer(schedule):
    model = tiny_model()
    batch = NativeEngine(model).generate(prompts([3, 7, 1]), params(schedule))
    assert_forced_at_budget(batch, BUDGET, INTERRUPTION, ANSWER)


def test_forcing_changes_nothing_before_the_budget_and_spares_closed_rows():
    model = tiny_model()
    engine = NativeEngine(model)
    plain = engine.generate(prompts([3, 7]), SamplingParams(temperature=1.0, max_new_tokens=BUDGET + 6, n=2, seed=5,
                                                            exit_policy="sample", ignore_eos=True))
    closer = plain.completion(0)[1]  # row 0 samples this token second: as the close marker it closes in time
    batch = engine.generate(prompts([3, 7]), params(close=[closer]))
    for r in range(batch.num_rows):
        assert batch.completion(r)[:BUDGET] == plain.completion(r)[:BUDGET]  # draws keyed by (seed, row, index)
        closed = closer in plain.completion(r)[:BUDGET]
        assert bool(batch.forced_mask[r].any()) == (not closed)
    assert not batch.forced_mask[0].any()
    assert batch.completion(0) == plain.completion(0)[:BUDGET]  # closed in time: max_new_tokens caps it


CASES = [(torch.float32, s, p) for s in ("dense", "deferred") for p in ("sample", "threshold:0.5")] + \
    [(torch.bfloat16, s, "sample") for s in ("dense", "deferred")]


@pytest.mark.parametrize("dtype,schedule,policy", CASES)
def test_replay_with_forced_tokens_is_bitwise(dtype, schedule, policy):
    model = tiny_model(dtype=dtype, injection="scalar", lora_rank=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = NativeEngine(model).generate(prompts([5, 1, 9]), params(schedule, policy, n=2))
    assert batch.forced_mask.any(dim=1).all()
    replay = replay_logprobs(model, batch)
    assert torch.equal(replay.logprobs, batch.logprobs)
    assert torch.equal(replay.tempered_logprobs, batch.tempered_logprobs)


def test_tokens_after_the_interruption_are_conditioned_on_it():
    """The answer's recorded log-probs equal a full forward over prompt + thinking + interruption."""
    model = tiny_model()
    batch = NativeEngine(model).generate(prompts([4, 6]), params("deferred", "sample"))
    dense = dense_logprobs(model, batch)
    sampled = batch.action_mask
    torch.testing.assert_close(dense.exit[sampled].detach(), batch.logprobs[sampled], atol=2e-5, rtol=0)


def test_forced_tokens_are_input_but_never_policy_actions():
    model = tiny_model(num_loops=3)
    batch = NativeEngine(model).generate(prompts([4, 6]), params("deferred", "sample"))
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    lb = LearnerBatch.from_rollout(batch, advantages)
    ids, attention, start = batch.padded_sequences()
    assert torch.equal(lb.input_ids, ids) and torch.equal(lb.attention_mask, attention)  # in the forward
    forced = torch.zeros_like(lb.target_mask)
    for r in range(batch.num_rows):
        columns = torch.nonzero(batch.forced_mask[r]).flatten() + start[r]
        forced[r, columns] = True
        assert lb.input_ids[r, columns].tolist() == INTERRUPTION
    assert forced.any() and not (lb.target_mask & forced).any()
    assert int(lb.target_mask.sum()) == int(batch.action_mask.sum())

    algo = AlgorithmConfig(kl_coef=0.1)  # policy loss (hybrid log-prob, sampler log-probs) + KL in the loss

    def loss_and_grads(b: LearnerBatch):
        model.zero_grad()
        out = rl_loss(score_tokens(model, b), b, algo, max_len=16)
        out.loss.backward()
        return out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref = lb.sampler_logprobs - 0.05 * torch.arange(lb.sampler_logprobs.numel()).view_as(lb.sampler_logprobs) / 97
    base = replace(lb, old_logprobs=lb.sampler_logprobs.clone(), ref_logprobs=ref)
    noise = torch.randn(lb.input_ids.shape) * 3
    perturbed = replace(base, sampler_logprobs=torch.where(forced, noise, base.sampler_logprobs),
                        old_logprobs=torch.where(forced, noise, base.old_logprobs),
                        ref_logprobs=torch.where(forced, -noise, base.ref_logprobs),
                        exit_steps=torch.where(forced, torch.full_like(base.exit_steps, 2), base.exit_steps))
    loss, grads = loss_and_grads(base)
    loss_p, grads_p = loss_and_grads(perturbed)
    assert torch.equal(loss, loss_p)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_p))
    # the check can fail: were the forced tokens targets, perturbing them would move the loss
    as_targets = replace(perturbed, target_mask=perturbed.target_mask | forced)
    assert not torch.equal(loss_and_grads(as_targets)[0], loss)


def test_thinking_budget_validation():
    model = tiny_model()
    with pytest.raises(RlttError, match="thinking.budget"):
        NativeEngine(model).generate(prompts([3]), replace(params(), thinking=thinking(budget=BUDGET + 1)))
    with pytest.raises(RlttError, match="thinking.interruption"):
        SamplingParams(thinking=ThinkingBudget(2, [1], [], 3)).validate()
    with pytest.raises(RlttError, match="thinking.close"):
        SamplingParams(thinking=ThinkingBudget(2, [100], [1], 3)).validate(vocab_size=61)


def test_the_forced_answer_rule_at_the_budget():
    """`ThinkingBudget.at_budget`, the rule both engines apply: closed in time → on to
    max_new_tokens; still open → the interruption and answer_budget more, when the interruption
    and one answer token fit the positions left; else the row ends (None)."""
    t = thinking()
    assert t.closed([1, *CLOSE, 2]) and not t.closed([1, CLOSE[0], 2, CLOSE[1]]) and not t.closed([])
    assert t.at_budget([1, *CLOSE, 2], 16, room=1) == ([], 16)  # closed: nothing forced, room irrelevant
    assert t.at_budget([1, 2, 3, 4], 16, room=len(INTERRUPTION) + 1) == (INTERRUPTION, 4 + len(INTERRUPTION) + ANSWER)
    assert t.at_budget([1, 2, 3, 4], 16, room=len(INTERRUPTION)) is None  # no position for an answer token
