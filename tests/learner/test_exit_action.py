"""The exit as part of the action (``algorithm.exit_action``): the joint log-prob
log π(t*, y) = log p_{t*} + log P^(t*)(y) in the loss, the ratio and the mismatch — the ratio exactly 1
at the rollout weights (fp32 and bf16, dense and deferred), and gradients equal to a naive joint
log-prob's, reaching the gate."""

import copy
from dataclasses import replace

import pytest
import torch

from rltt.errors import ConfigError
from rltt.learner import AlgorithmConfig, Learner, LearnerBatch, LearnerConfig, score_tokens
from rltt.learner.loss import rl_loss
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.rollout import NativeEngine, SamplingParams

from tests.rollout.helpers import prompts, tiny_model

from .helpers import synthetic_batch, tiny_policy


def _rollout(dtype, schedule):
    model = tiny_model(dtype=dtype)
    params = SamplingParams(temperature=0.9, max_new_tokens=7, n=2, seed=3, exit_policy="sample", schedule=schedule)
    batch = NativeEngine(model).generate(prompts([4, 6], seed=1), params)
    return model, LearnerBatch.from_rollout(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]))


def _update(model, batch, dtype, **algo):
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=2, dtype="bf16" if dtype == torch.bfloat16 else "fp32")
    learner = Learner(copy.deepcopy(model).float(), cfg, AlgorithmConfig(track_kl=False, **algo),
                      batch_size=batch.size, max_len=7, rollout_dtype=dtype)
    return learner.update(batch)


CASES = [(d, s) for d in (torch.float32, torch.bfloat16) for s in ("dense", "deferred")]


@pytest.mark.parametrize("dtype,schedule", CASES)
def test_ratio_is_exactly_one_at_the_rollout_weights_with_the_exit_in_the_action(dtype, schedule):
    model, batch = _rollout(dtype, schedule)
    mask = batch.target_mask
    assert (batch.sampler_exit_logprobs[mask] < 0).any() and (batch.sampler_exit_logprobs[~mask] == 0).all()
    metrics = _update(model, batch, dtype, exit_action=True)
    assert metrics["policy/ratio_mean"] == 1.0 and metrics["policy/ratio_max"] == 1.0
    assert metrics["policy/ratio_min"] == 1.0 and metrics["policy/clip_frac"] == 0.0
    if dtype == torch.float32:
        assert metrics["mismatch/max_abs"] < 1e-4  # the learner's joint log-prob is the sampler's


@pytest.mark.slow  # two learner updates: ~2 s idle, 20+ s on a loaded machine
def test_the_mismatch_compares_the_joint_logprob():
    """A sampler side without its exit half reads as a large mismatch (the ratio stays anchored)."""
    model, batch = _rollout(torch.float32, "deferred")
    half = _update(model, replace(batch, sampler_exit_logprobs=torch.zeros_like(batch.sampler_logprobs)),
                   torch.float32, exit_action=True)
    assert half["mismatch/max_abs"] > 1e-2 and half["policy/ratio_mean"] == 1.0
    assert _update(model, batch, torch.float32)["mismatch/max_abs"] < 1e-4  # without exit_action: the token alone


def _naive_joint(model, batch):
    """log p_{t*} + log P^(t*)(y) of every completion token from the plain forward's per-step logits
    and exit distribution (the state at position i produces the token at i + 1)."""
    out = model(batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, output_step_logits=True)
    logp = out.step_logits.float().log_softmax(-1)[:, :, :-1]  # (T, B, S-1, V)
    targets = batch.input_ids[:, 1:]
    token = logp.gather(-1, targets[None, :, :, None].expand(logp.shape[0], -1, -1, 1))[..., 0]
    steps = (batch.exit_steps[:, 1:] - 1)[None]
    exit_p = out.exit_probs.float()[:, :, :-1]
    return token.gather(0, steps)[0] + exit_p.gather(0, steps)[0].log(), batch.target_mask[:, 1:]


@pytest.mark.parametrize("hybrid", [False, True])
def test_gradients_equal_a_naive_joint_logprob_and_reach_the_gate(hybrid):
    batch = synthetic_batch()
    algo = AlgorithmConfig(exit_action=True, loss="reinforce", hybrid_logprob=hybrid, track_kl=False)
    model = tiny_policy()
    if hybrid:  # the sampler's values anchor the loss; the gradient stays the dense one
        with torch.no_grad():
            joint, mask = _naive_joint(model, batch)
        batch.sampler_logprobs = torch.zeros(batch.input_ids.shape)
        batch.sampler_exit_logprobs = torch.zeros(batch.input_ids.shape)
        batch.sampler_logprobs[:, 1:][mask] = joint[mask] + 1e-3
    rl_loss(score_tokens(model, batch), batch, algo, max_len=8).loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    naive = tiny_policy()
    joint, mask = _naive_joint(naive, batch)
    adv = batch.advantages[:, None].expand_as(joint)
    (-(adv * joint)[mask].sum() / mask.sum()).backward()
    want = {n: p.grad for n, p in naive.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    gate = "model.exit_gate.weight"
    assert got[gate].abs().sum() > 0  # the exit choice trains the gate

    plain = tiny_policy()  # the token log-prob alone: no gradient reaches the gate
    token_only = replace(algo, exit_action=False, hybrid_logprob=False)
    rl_loss(score_tokens(plain, batch), batch, token_only, max_len=8).loss.backward()
    assert plain.get_parameter(gate).grad is None or plain.get_parameter(gate).grad.abs().sum() == 0


def test_exit_action_needs_sampled_exits_and_the_exit_logprob():
    recipe = "recipes/quickstart.yaml"
    assert load_train_recipe(recipe, ["algorithm.exit_action=true", "rollout.exit_policy=sample"]).algorithm.exit_action
    for policy in ("threshold:0.5", "final"):
        with pytest.raises(ConfigError, match=r"'algorithm.exit_action'.*rollout.exit_policy: sample") as err:
            load_train_recipe(recipe, ["algorithm.exit_action=true", f"rollout.exit_policy={policy}"])
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"'algorithm.exit_action'.*policy_logprob: exit"):
        AlgorithmConfig(exit_action=True, policy_logprob="final")
