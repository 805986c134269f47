"""Thinking budget with a forced answer in VllmEngine: the interruption at the budget, its forced
mask, the answer after it, reproducibility, and greedy rows equal to the native engine's."""

from __future__ import annotations

import pytest
import torch

from rltt.orchestration.train_recipe import load_train_recipe
from rltt.rollout import NativeEngine, SamplingParams
from rltt.rollout.params import ThinkingBudget
from tests.data.chat_tokenizer import chat_tokenizer
from tests.rollout.helpers import assert_forced_at_budget
from tests.vllm.helpers import ENGINE_OPTIONS, PROMPTS, looped_model, needs_vllm

BUDGET, ANSWER = 4, 3


@pytest.fixture(scope="module")
def setup():
    from rltt.vllm.vllm_engine import VllmEngine

    tok = chat_tokenizer()
    close = tok.encode("</think>", add_special_tokens=False)
    interruption = tok.encode("\n\nTime is up.\n</think>\n\n", add_special_tokens=False)
    assert interruption[-len(close) - 2:-2] == close
    model = looped_model(num_loops=2, seed=0, vocab_size=len(tok) + 4)
    engine = VllmEngine(model, **ENGINE_OPTIONS)
    yield model, engine, close, interruption
    engine.close()


def params(close, interruption, budget=BUDGET, temperature=1.0, policy="sample", max_new_tokens=BUDGET, n=2):
    return SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=n, seed=5, exit_policy=policy,
                          schedule="dense", ignore_eos=True,
                          thinking=ThinkingBudget(budget=budget, close=list(close), interruption=list(interruption),
                                                  answer_budget=ANSWER))


def same_rows(a, b):
    assert torch.equal(a.completion_lengths, b.completion_lengths)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.exit_steps, b.exit_steps)
    assert torch.equal(a.forced_mask, b.forced_mask)
    assert a.finish_reasons == b.finish_reasons


@pytest.mark.heavy
@pytest.mark.slow
@needs_vllm
def test_every_row_forced_holds_the_interruption_then_its_answer(setup):
    _, engine, close, interruption = setup
    p = params(close, interruption)
    batch = engine.generate(PROMPTS, p)
    assert_forced_at_budget(batch, BUDGET, interruption, ANSWER)
    for r in range(batch.num_rows):
        assert close[0] not in batch.completion(r)[:BUDGET]  # thinking left open: the row was forced
    assert int(batch.action_mask.sum()) == batch.num_rows * (BUDGET + ANSWER)
    same_rows(engine.generate(PROMPTS, p), batch)  # the same row keys in both segments: reproducible


@pytest.mark.heavy
@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("policy", ["final", "threshold:0.5", "sample"])
def test_greedy_rows_equal_native(setup, policy):
    model, engine, close, interruption = setup
    native = NativeEngine(model)
    forced_all = params(close, interruption, temperature=0, policy=policy, n=1)
    got, want = engine.generate(PROMPTS, forced_all), native.generate(PROMPTS, forced_all)
    same_rows(got, want)
    assert got.forced_mask.any(dim=1).all()
    mask = got.completion_mask
    assert torch.allclose(got.logprobs[mask], want.logprobs[mask], atol=1e-4)

    # a close marker that row 0 samples within the budget: row 0 goes on to max_new_tokens unforced
    plain = native.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=BUDGET + 6, exit_policy=policy,
                                                    schedule="dense", ignore_eos=True))
    closer = plain.completion(0)[1]
    mixed = params([closer], interruption, temperature=0, policy=policy, max_new_tokens=BUDGET + 6, n=1)
    got, want = engine.generate(PROMPTS, mixed), native.generate(PROMPTS, mixed)
    same_rows(got, want)
    assert not got.forced_mask[0].any() and got.completion(0) == plain.completion(0)
    if policy == "sample":
        assert got.exit_steps[got.action_mask].unique().numel() > 1  # the keyed exit draws really decided


def test_recipe_takes_a_thinking_budget_with_vllm():
    recipe = load_train_recipe(None, ["rollout.engine=vllm", "rollout.schedule=dense", "rollout.thinking.budget=4",
                                      "rollout.thinking.answer_budget=2", "rollout.max_new_tokens=8"])
    assert recipe.rollout.engine == "vllm" and recipe.rollout.thinking.budget == 4
