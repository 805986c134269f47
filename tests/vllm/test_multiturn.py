"""Multi-turn episodes on the vLLM engine: each turn re-submits prompt + history (vLLM's prefix
cache reuses its KV); the environment's tokens are masked, and the learner scores the episode at
the rollout weights with ratio exactly 1 and the sampler's log-probs on every model token."""

from __future__ import annotations

import copy

import pytest
import torch

from rltt.learner import AlgorithmConfig, Learner, LearnerBatch, LearnerConfig
from rltt.orchestration.episodes import run_episodes
from rltt.rollout import SamplingParams
from tests.environments.helpers import ScriptedEnv, decode, encode
from tests.vllm.helpers import ENGINE_OPTIONS, PROMPTS, looped_model, needs_vllm

ANSWER = (11, 12, 13)


@pytest.fixture(scope="module")
def setup():
    from rltt.vllm.vllm_engine import VllmEngine

    model = looped_model(num_loops=2, seed=0)
    engine = VllmEngine(model, **ENGINE_OPTIONS)
    yield model, engine
    engine.close()


def _run(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, prompt_seeds=[3, 5, 7, 9, 11],
                            stop_token_ids=[5, 6, 7, 8, 10], exit_policy="sample", schedule="dense")
    return run_episodes(engine, PROMPTS, params, ScriptedEnv(ANSWER), list(range(len(PROMPTS))), encode, decode,
                        max_turns=4, max_tokens=30, keep_turns=True)


@pytest.mark.heavy
@pytest.mark.slow
@needs_vllm
def test_vllm_episodes_record_model_tokens_and_mask_the_environment(setup):
    model, engine = setup
    episodes = _run(engine)
    ro = episodes.rollout
    assert int(episodes.tool_calls.sum()) > 0 and ro.env_mask.any()
    for record in episodes.turns_record:
        for i, (r, col, keep) in enumerate(zip(record.rows, record.columns, record.kept)):
            tb = record.batch
            assert tb.sequence(i)[: tb.prompt_lengths[i]] == ro.sequence(r)[: ro.prompt_lengths[r] + col]
            for name in ("completion_ids", "exit_steps", "logprobs", "tempered_logprobs", "exit_logprobs"):
                assert torch.equal(getattr(ro, name)[r, col:col + keep], getattr(tb, name)[i, :keep]), name
    assert (ro.logprobs[ro.env_mask] == 0).all() and torch.equal(ro.action_mask, ro.completion_mask & ~ro.env_mask)
    again = _run(engine)  # the same prompt seeds: the same episodes
    assert torch.equal(again.rollout.completion_ids, ro.completion_ids)
    assert torch.equal(again.rollout.exit_steps, ro.exit_steps)

    batch = LearnerBatch.from_rollout(ro, torch.linspace(-1, 1, ro.num_rows))
    learner = Learner(copy.deepcopy(model), LearnerConfig(lr=1e-3, micro_batch_size=5),
                      AlgorithmConfig(track_kl=False), batch_size=ro.num_rows, max_len=30)
    metrics = learner.update(batch)
    assert metrics["policy/ratio_mean"] == 1.0 and metrics["policy/ratio_max"] == 1.0
    assert metrics["policy/ratio_min"] == 1.0
    assert metrics["mismatch/max_abs"] < 1e-4  # vLLM against the learner's dense forward (fp32)
