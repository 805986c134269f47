"""Exit policies are honoured; stop tokens, stop strings and max tokens end completions."""

import pytest
import torch

from rltt.model import exit_distribution
from rltt.rollout import NativeEngine, SamplingParams

from .helpers import prompts, tiny_model


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_fixed_and_final_exits(schedule):
    engine = NativeEngine(tiny_model(num_loops=3))
    for policy, expected in (("fixed:1", 1), ("fixed:2", 2), ("final", 3)):
        batch = engine.generate(prompts([4, 2]), SamplingParams(max_new_tokens=5, seed=0, exit_policy=policy,
                                                                schedule=schedule))
        assert (batch.exit_steps[batch.completion_mask] == expected).all()
        assert (batch.exit_steps[~batch.completion_mask] == 0).all()


def test_model_config_exit_policy_is_the_default():
    engine = NativeEngine(tiny_model(num_loops=3, exit_policy="fixed:2"))
    batch = engine.generate(prompts([3]), SamplingParams(max_new_tokens=4, seed=0))
    assert (batch.exit_steps == 2).all()


@pytest.mark.parametrize("q", [0.3, 0.7, 1.0])
def test_threshold_exit_is_the_first_step_whose_cdf_reaches_q(q):
    T = 4
    batch = NativeEngine(tiny_model(num_loops=T)).generate(
        prompts([3, 6], seed=4), SamplingParams(max_new_tokens=10, seed=1, exit_policy=f"threshold:{q}",
                                                schedule="dense"))
    mask = batch.completion_mask
    cdf = exit_distribution(batch.gate_probs).cumsum(0)[:, mask]  # dense: all T gates recorded
    reached = cdf >= q
    reached[-1] = True
    assert torch.equal(reached.float().argmax(0) + 1, batch.exit_steps[mask])
    assert len(set(batch.exit_steps[mask].tolist())) > 1


def test_sample_exits_follow_the_exit_distribution():
    T = 4
    model = tiny_model(num_loops=T, gate_bias=0.0)
    batch = NativeEngine(model).generate(prompts([4] * 6, seed=9), SamplingParams(
        max_new_tokens=40, n=2, seed=5, exit_policy="sample", schedule="dense"))
    # dense computes all T gates of every token but the last of a row (it stops at its exit)
    mask = batch.completion_mask & ~torch.isnan(batch.gate_probs).any(0)
    probs = exit_distribution(batch.gate_probs)[:, mask]  # (T, N)
    exits = batch.exit_steps[mask]
    counts = torch.bincount(exits - 1, minlength=T).float()
    expected = probs.sum(1)
    n = exits.numel()
    assert n >= 300
    # each count within 5 standard deviations of its expectation (sum of Bernoullis)
    std = (probs * (1 - probs)).sum(1).sqrt()
    assert ((counts - expected).abs() <= 5 * std + 1).all(), (counts, expected)
    assert (counts > 0).sum() >= 3


def test_stop_token_and_max_tokens():
    engine = NativeEngine(tiny_model())
    base = engine.generate(prompts([5, 5, 5], seed=6), SamplingParams(max_new_tokens=12, seed=2, temperature=0))
    assert base.finish_reasons == ["length"] * 3 and (base.completion_lengths == 12).all()
    stop = base.completion_ids[0, 4].item()
    batch = engine.generate(prompts([5, 5, 5], seed=6), SamplingParams(max_new_tokens=12, seed=2, temperature=0,
                                                                       stop_token_ids=[stop]))
    for row in range(3):
        full = base.completion(row)
        if stop in full:
            cut = full.index(stop) + 1
            assert batch.completion(row) == full[:cut] and batch.finish_reasons[row] == "stop"
        else:
            assert batch.completion(row) == full and batch.finish_reasons[row] == "length"
    assert batch.completion_lengths[0] == 5
    assert not batch.completion_mask[0, 5:].any() and batch.completion_mask[0, :5].all()


def test_eos_from_config_unless_ignored():
    model = tiny_model()
    first = NativeEngine(model).generate(prompts([5]), SamplingParams(max_new_tokens=8, temperature=0)).completion(0)
    model.config.eos_token_id = first[2]
    batch = NativeEngine(model).generate(prompts([5]), SamplingParams(max_new_tokens=8, temperature=0))
    assert batch.completion(0) == first[: first.index(first[2]) + 1] and batch.finish_reasons == ["stop"]
    ignored = NativeEngine(model).generate(prompts([5]), SamplingParams(max_new_tokens=8, temperature=0,
                                                                        ignore_eos=True))
    assert ignored.completion(0) == first


def test_stop_strings_with_a_decoder():
    engine = NativeEngine(tiny_model())

    def decode(ids):
        return " ".join(f"t{i}" for i in ids)

    base = engine.generate(prompts([4, 7]), SamplingParams(max_new_tokens=10, temperature=0))
    target = f"t{base.completion(1)[3]} t{base.completion(1)[4]}"  # spans two tokens
    batch = engine.generate(prompts([4, 7]), SamplingParams(max_new_tokens=10, temperature=0,
                                                            stop_strings=[target], decoder=decode))
    assert batch.completion(1) == base.completion(1)[:5] or target in decode(batch.completion(1))
    assert target in decode(batch.completion(1)) and batch.finish_reasons[1] == "stop"
    assert target not in decode(batch.completion(1)[:-1])
