"""A learner update with each policy loss, advantage estimator and rollout correction of the tables
in `rltt.objectives` (docs/design.md §5.5–5.6) runs, changes the parameters and logs what it did."""

import copy
import math

import pytest
import torch

from rltt.learner import AlgorithmConfig, Learner, LearnerConfig, score_tokens
from rltt.objectives import CORRECTIONS, CorrectionParams, correction_weights, group_advantages, policy_logprob

from .helpers import synthetic_batch, tiny_policy


def _sampler_logprobs(model, batch, noise):
    """The exit log-probs at the current weights plus noise: a sampler that disagrees with the learner."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        s = score_tokens(model, batch)
        exact = s.to_rows(policy_logprob("exit", s.logprobs, exit_steps=s.exit_steps))
    return exact + noise * torch.randn(exact.shape, generator=g) * batch.target_mask


def _update(algo: AlgorithmConfig, batch=None, noise=None, micro=2, seed=0):
    model = tiny_policy(seed)
    batch = batch or synthetic_batch()
    if noise is not None:
        batch.sampler_logprobs = _sampler_logprobs(model, batch, noise)
    before = copy.deepcopy(model.state_dict())
    learner = Learner(model, LearnerConfig(lr=1e-2, micro_batch_size=micro), algo, batch_size=batch.size, max_len=8)
    metrics = learner.update(batch)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    return metrics, changed, batch


@pytest.mark.parametrize("policy_logprob", ["exit", "final", "mixture", "rltt"])
@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_each_new_loss_with_each_policy_logprob_changes_parameters(loss, policy_logprob):
    # two epochs, so the second one sees ratios ≠ 1; wide GSPO bounds so its clip does not zero everything
    algo = AlgorithmConfig(loss=loss, policy_logprob=policy_logprob, ppo_epochs=2, gspo_eps_low=0.2, gspo_eps_high=0.2)
    metrics, changed, _ = _update(algo, noise=1e-3)
    assert "lm_head.weight" in changed and any("layers.0" in k for k in changed)
    for key in ("loss/total", "loss/policy", "policy/clip_frac", "policy/ratio_max", "grad_norm/total"):
        assert math.isfinite(metrics[key]), key
    assert not any(k.startswith("correction/") for k in metrics)  # no correction: its keys are absent


@pytest.mark.parametrize("loss, aggregation", [("gspo", "seq_mean_token_mean"), ("cispo", "token_mean"),
                                               ("gspo", "seq_mean_token_sum_norm")])
def test_new_losses_do_not_depend_on_the_micro_batch_size(loss, aggregation):
    runs = [_update(AlgorithmConfig(loss=loss, aggregation=aggregation), micro=micro)[0] for micro in (1, 4)]
    for key in ("loss/total", "grad_norm/total"):
        assert runs[1][key] == pytest.approx(runs[0][key], rel=1e-5), key


@pytest.mark.parametrize("estimator, scale", [("rloo", "none"), ("rloo", "group"), ("reinforce_pp", "batch")])
def test_each_estimator_feeds_an_update(estimator, scale):
    batch = synthetic_batch()
    rewards = torch.tensor([1.0, 0.0, 0.3, 1.0])
    batch.advantages = group_advantages(rewards, 2, scale, estimator=estimator).advantages
    assert bool((batch.advantages != 0).all())
    metrics, changed, _ = _update(AlgorithmConfig(advantage=estimator, advantage_scale=scale), batch=batch)
    assert "lm_head.weight" in changed and math.isfinite(metrics["loss/total"])


@pytest.mark.parametrize("correction", [c for c in CORRECTIONS if c != "none"])
def test_each_correction_updates_and_logs_its_share(correction):
    params = dict(correction_cap=1.2, correction_lo=0.9, correction_hi=1.1, decoupled_cap=1.2)
    algo = AlgorithmConfig(correction=correction, aggregation="seq_mean_token_mean", **params)
    noise = 0.15  # a sampler far enough from the learner that some ratios leave [0.9, 1.1]
    metrics, changed, batch = _update(algo, noise=noise)
    assert "lm_head.weight" in changed
    for key in ("correction/masked_frac", "correction/weight_mean", "correction/weight_max"):
        assert key in metrics and math.isfinite(metrics[key]), key
    # the share logged is the share of completion tokens the correction rejects at the rollout weights
    model = tiny_policy(0)
    with torch.no_grad():
        s = score_tokens(model, batch)
        learner = s.to_rows(policy_logprob("exit", s.logprobs, exit_steps=s.exit_steps))
    expected = correction_weights(correction, learner, batch.sampler_logprobs, batch.target_mask,
                                  CorrectionParams(1.2, 0.9, 1.1, 1.2))
    mask = batch.target_mask.bool()
    assert metrics["correction/masked_frac"] == pytest.approx(int(expected.masked.sum()) / int(mask.sum()), abs=1e-12)
    kept = mask & ~expected.masked
    if bool(kept.any()):
        assert metrics["correction/weight_mean"] == pytest.approx(float(expected.weight[kept].mean()), rel=1e-4)
        assert metrics["correction/weight_max"] == pytest.approx(float(expected.weight[kept].max()), rel=1e-4)
    if correction.endswith("mask") or correction == "decoupled":  # decoupled masks above its cap
        assert 0 < metrics["correction/masked_frac"] < 1
    else:
        assert metrics["correction/masked_frac"] == 0 and metrics["correction/weight_max"] <= 1.2 + 1e-6
    # the counts are exact whatever the micro-batch size
    again, _, _ = _update(algo, noise=noise, micro=1)
    assert again["correction/masked_frac"] == metrics["correction/masked_frac"]


def test_correction_under_the_hybrid_log_prob_compares_the_learner_with_the_sampler():
    """The hybrid log-prob makes the PPO ratio exactly 1 at the rollout weights, but the sampler still
    differs from the learner: the correction's weights are the learner/sampler ratios, not 1."""
    metrics, _, _ = _update(AlgorithmConfig(correction="token_tis", correction_cap=10.0), noise=0.05)
    assert metrics["policy/ratio_max"] == 1.0 and metrics["policy/ratio_min"] == 1.0
    assert metrics["correction/weight_max"] > 1.0
    legacy, _, _ = _update(AlgorithmConfig(tis_cap=10.0), noise=0.05)
    assert legacy["correction/weight_max"] == metrics["correction/weight_max"]
    assert legacy["loss/total"] == metrics["loss/total"]
