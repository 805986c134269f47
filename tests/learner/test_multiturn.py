"""The learner on multi-turn episodes: environment tokens are attended to but never trained on.

A batch of native-engine episodes (tests/environments: a scripted environment answers turns
that "call a tool"; the engine continues each row with its KV kept between turns,
`rltt.rollout.continuation`) goes through the learner: at the rollout weights the ratio is exactly 1 and
the learner's log-prob of every model token is the sampler's (the history, environment tokens
included, is the context it was sampled in); the loss aggregations count model tokens only
(hand-computed), and the loss has no gradient through an environment token's log-prob even when
a scorer hands them in."""

import copy
import functools
from dataclasses import replace

import pytest
import torch

from rltt.learner import AlgorithmConfig, Learner, LearnerBatch, LearnerConfig, score_tokens
from rltt.learner.loss import rl_loss
from rltt.learner.scoring import LoopScores
from rltt.orchestration.episodes import run_episodes
from rltt.orchestration.groups import compute_penalty
from rltt.rollout import NativeEngine, SamplingParams

from tests.environments.helpers import ScriptedEnv, decode, encode
from tests.rollout.helpers import prompts, tiny_model

ADVANTAGES = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, -0.25])


@functools.lru_cache(maxsize=2)  # one episode batch per schedule for the module (the model is never trained in place)
def _episodes(schedule="deferred"):
    model = tiny_model()
    params = SamplingParams(temperature=1.0, top_k=40, max_new_tokens=6, n=2, prompt_seeds=[5, 17, 23],
                            stop_token_ids=[5, 6, 7, 8, 10], exit_policy="sample", schedule=schedule)
    episodes = run_episodes(NativeEngine(model), prompts([4, 6, 3], seed=2), params, ScriptedEnv(), ["a", "b", "c"],
                            encode, decode, max_turns=4, max_tokens=30)
    assert episodes.rollout.env_mask.any()
    assert episodes.rollout.schedule.replayable  # continued rows: the native engine's turn sessions kept the KV
    return model, episodes.rollout, LearnerBatch.from_rollout(episodes.rollout, ADVANTAGES)


@pytest.mark.slow  # a learner update per case: a few seconds idle, minutes on a loaded machine
@pytest.mark.parametrize("schedule, exit_action", [("dense", False), ("deferred", False), ("deferred", True)])
def test_ratio_is_exactly_one_and_the_learner_scores_what_the_sampler_drew(schedule, exit_action):
    model, rollout, batch = _episodes(schedule)
    assert batch.env_mask is not None and not (batch.env_mask & batch.target_mask).any()
    assert int(batch.env_mask.sum()) == int(rollout.env_mask.sum())
    assert int(batch.target_mask.sum()) == int(rollout.action_mask.sum())
    assert bool((batch.env_mask & batch.attention_mask.bool()).sum() == batch.env_mask.sum())  # attended to
    learner = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, micro_batch_size=3),
                      AlgorithmConfig(track_kl=False, exit_action=exit_action), batch_size=6, max_len=30)
    metrics = learner.update(batch)
    assert metrics["policy/ratio_mean"] == 1.0 and metrics["policy/ratio_max"] == 1.0
    assert metrics["policy/ratio_min"] == 1.0 and metrics["policy/clip_frac"] == 0.0
    # every model token's learner log-prob is the sampler's (with exit_action: the joint log-prob,
    # exit included): its context (the episode before it, the environment's tokens included) is
    # the one it was sampled in
    assert metrics["mismatch/max_abs"] < 1e-4


def test_the_compute_price_counts_model_tokens_only():
    _, rollout, _ = _episodes()
    model = rollout.action_mask
    expected = (rollout.exit_steps * model).sum(1).double() / model.sum(1).double() / rollout.num_loops
    assert torch.equal(compute_penalty(rollout, 1.0), expected)
    with_env = rollout.completion_mask.sum(1).double()  # counting environment tokens would lower it
    assert (with_env > model.sum(1)).any()


def test_a_target_on_an_environment_token_is_refused():
    _, _, batch = _episodes()
    with pytest.raises(ValueError, match="environment tokens"):
        replace(batch, target_mask=batch.target_mask | batch.env_mask)


def _wide_scores(model, batch):
    """Scores over every completion token, the environment's included (what a scorer that ignored
    env_mask would hand the loss), as a leaf that records gradients."""
    wide = batch.target_mask | batch.env_mask
    with torch.no_grad():
        scores = score_tokens(model, replace(batch, target_mask=wide, env_mask=None))
    return LoopScores(scores.logprobs.clone().requires_grad_(True), scores.entropy, scores.exit_probs,
                      scores.exit_steps, wide)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregation_counts_model_tokens_only(aggregation):
    model, rollout, batch = _episodes()
    scores = _wide_scores(model, batch)
    algo = AlgorithmConfig(aggregation=aggregation, hybrid_logprob=False, track_kl=False)
    loss = rl_loss(scores, batch, algo, max_len=30).policy_loss
    # at old = current every PPO token loss is -A of its row; n_b = the row's model tokens
    n = rollout.action_mask.sum(dim=1).double()
    envs = rollout.env_mask.sum(dim=1).double()
    assert (envs[ADVANTAGES != 0] > 0).any()  # counting environment tokens would change the value
    A = ADVANTAGES.double()
    expected = {"token_mean": -(A * n).sum() / n.sum(),
                "seq_mean_token_mean": -A[n > 0].sum() / (n > 0).sum(),
                "seq_mean_token_sum_norm": -(A * n).sum() / (len(A) * 30)}[aggregation]
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


def test_environment_tokens_get_no_gradient():
    model, rollout, batch = _episodes()
    scores = _wide_scores(model, batch)
    algo = AlgorithmConfig(hybrid_logprob=False, track_kl=False, kl_coef=0.0)
    rl_loss(scores, batch, algo, max_len=30).loss.backward()
    grad = scores.logprobs.grad  # (T, N) over every completion token, row-major like the wide mask
    env = batch.env_mask[scores.target_mask]  # (N,) which of them are the environment's
    assert env.any() and (~env).any()
    assert (grad[:, env] == 0).all()
    assert (grad[:, ~env] != 0).any()
