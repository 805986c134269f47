"""The learner: scoring against the full forward, hybrid log-prob exactness, micro-batch invariance."""

import copy

import pytest
import torch

from rltt.learner import AlgorithmConfig, Learner, LearnerConfig, score_tokens
from rltt.errors import ConfigError

from .helpers import synthetic_batch, tiny_policy


def test_scores_match_the_full_forward_per_step_logits():
    model = tiny_policy().eval()
    batch = synthetic_batch()
    with torch.no_grad():
        scores = score_tokens(model, batch)
        out = model(batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, output_step_logits=True)
    logp = out.step_logits.float().log_softmax(-1)[:, :, :-1]  # (T, B, S-1, V) predicting positions 1..
    targets = batch.input_ids[:, 1:]
    expected = logp.gather(-1, targets[None, :, :, None].expand(logp.shape[0], -1, -1, 1))[..., 0]
    expected = expected[:, batch.target_mask[:, 1:]]
    torch.testing.assert_close(scores.logprobs, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores.exit_probs.sum(0), torch.ones(expected.shape[1]), rtol=0, atol=1e-5)
    assert torch.equal(scores.exit_steps, batch.exit_steps[batch.target_mask])


def _sampler_logprobs(model, batch, noise=1e-3):
    with torch.no_grad():
        s = score_tokens(model, batch)
        exact = s.logprobs.gather(0, (s.exit_steps - 1)[None])[0]
    return s.to_rows(exact + noise * torch.randn_like(exact))


def test_hybrid_ratio_is_exactly_one_at_the_rollout_weights():
    model = tiny_policy()
    batch = synthetic_batch()
    batch.sampler_logprobs = _sampler_logprobs(model, batch)
    learner = Learner(model, LearnerConfig(lr=1e-3, micro_batch_size=2), AlgorithmConfig(), batch_size=4, max_len=8)
    metrics = learner.update(batch)
    assert metrics["policy/ratio_mean"] == 1.0 and metrics["policy/ratio_max"] == 1.0
    assert metrics["policy/ratio_min"] == 1.0 and metrics["policy/clip_frac"] == 0.0
    assert 0 < metrics["mismatch/max_abs"] < 1e-2  # the injected sampler noise is reported
    # without the hybrid form the same noise shows up as ratios ≠ 1
    model2 = tiny_policy()
    learner2 = Learner(model2, LearnerConfig(lr=1e-3, micro_batch_size=2), AlgorithmConfig(hybrid_logprob=False),
                       batch_size=4, max_len=8)
    batch2 = synthetic_batch()
    batch2.sampler_logprobs = batch.sampler_logprobs
    assert learner2.update(batch2)["policy/ratio_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["exit", "final", "mixture", "rltt"])
def test_a_step_changes_parameters(kind):
    model = tiny_policy()
    before = copy.deepcopy(model.state_dict())
    learner = Learner(model, LearnerConfig(lr=1e-2), AlgorithmConfig(policy_logprob=kind, kl_coef=0.1),
                      batch_size=4, max_len=8)
    metrics = learner.update(synthetic_batch())
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("layers.0" in k for k in changed) and "lm_head.weight" in changed
    assert metrics["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # reference = the rollout weights
    for key in ("loss/total", "grad_norm/total", "grad_norm/layer/0", "grad_norm/group/block", "entropy/loop_3",
                "exit/p_1", "exit/mean_step"):
        assert key in metrics, key
    # only the mixture log-prob depends on the gate (exit replays t*, rltt detaches p by default)
    assert ("grad_norm/group/gate" in metrics) == (kind == "mixture")


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batch_size_does_not_change_the_update(agg):
    runs = []
    for micro in (1, 2, 4):
        model = tiny_policy()
        learner = Learner(model, LearnerConfig(lr=1e-2, micro_batch_size=micro),
                          AlgorithmConfig(aggregation=agg, loss="reinforce"), batch_size=4, max_len=8)
        runs.append(learner.update(synthetic_batch()))
    for key in ("loss/total", "grad_norm/total", "grad_norm/layer/0", "grad_norm/layer/1", "grad_norm/group/lm_head"):
        assert runs[1][key] == pytest.approx(runs[0][key], rel=1e-5), key
        assert runs[2][key] == pytest.approx(runs[0][key], rel=1e-5), key


def test_bad_algorithm_settings():
    with pytest.raises(ConfigError, match="algorithm.policy_logprob"):
        AlgorithmConfig(policy_logprob="last")
    with pytest.raises(ConfigError, match="algorithm.kl_estimator"):
        AlgorithmConfig(kl_estimator="k4")
    with pytest.raises(ConfigError, match="learner.zero_stage"):
        LearnerConfig(zero_stage=4)


def test_several_ppo_epochs_score_old_logprobs_once_and_move_the_ratio():
    model = tiny_policy()
    batch = synthetic_batch()
    batch.sampler_logprobs = _sampler_logprobs(model, batch, noise=0.0)
    learner = Learner(model, LearnerConfig(lr=5e-2, micro_batch_size=2), AlgorithmConfig(ppo_epochs=3),
                      batch_size=4, max_len=8)
    metrics = learner.update(batch)
    # the last epoch runs at updated weights: the ratio has left 1, and the telemetry is there
    assert metrics["policy/ratio_max"] > 1.0 or metrics["policy/ratio_min"] < 1.0
    assert metrics["mismatch/max_abs"] < 1e-5 and "entropy/loop_1" in metrics


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum_norm"])
def test_packed_scoring_gives_the_padded_update(aggregation):
    """learner.pack_sequences (each group's prompt once, no padding) changes no number beyond rounding."""
    batch = synthetic_batch(B=6, group_size=3, seed=3)
    batch.input_ids[:, :3] = batch.input_ids[::3, :3].repeat_interleave(3, 0)  # a shared prompt per group
    params, logged = [], []
    for pack in (True, False):
        model = tiny_policy(seed=1)
        learner = Learner(model, LearnerConfig(lr=1e-2, micro_batch_size=3, pack_sequences=pack),
                          AlgorithmConfig(ppo_epochs=2, aggregation=aggregation, kl_coef=0.05), batch_size=6, max_len=8)
        logged.append(learner.update(copy.deepcopy(batch)))
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    # Adam divides by sqrt(v): a parameter whose gradient is ~0 moves by a rounding-sized amount
    # times lr in either run, so allow 0.5 % of one lr = 1e-2 step
    torch.testing.assert_close(params[0], params[1], rtol=1e-5, atol=5e-5)
    for key in ("loss/total", "kl/ref", "grad_norm/total"):
        if key in logged[1]:
            assert logged[0][key] == pytest.approx(logged[1][key], rel=1e-4, abs=1e-6), key
