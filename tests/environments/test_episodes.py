"""Multi-turn episodes around the native engine: the model's tokens are recorded exactly as their
turns sampled them, the environment's are masked, replaying the turns reproduces the episode bit
for bit, and a rerun with the same seeds is the same episode."""

import pytest
import torch

from rltt.orchestration.episodes import replay_episode, run_episodes
from rltt.rollout import NativeEngine, SamplingParams

from tests.rollout.helpers import prompts, tiny_model

from .helpers import ScriptedEnv, decode, encode

ANSWER = (11, 12, 13)


def _params(schedule="deferred", **kw):
    fields = dict(temperature=1.0, top_k=40, max_new_tokens=6, n=2, prompt_seeds=[5, 17, 23],
                  stop_token_ids=[5, 6, 7, 8, 10], exit_policy="sample", schedule=schedule)
    fields.update(kw)
    return SamplingParams(**fields)


def _run(model, schedule="deferred", max_turns=4, max_tokens=30, env=None, **kw):
    env = env or ScriptedEnv(ANSWER)
    tasks = ["a", "b", "c"]
    episodes = run_episodes(NativeEngine(model), prompts([4, 6, 3], seed=2), _params(schedule, **kw), env, tasks,
                            encode, decode, max_turns=max_turns, max_tokens=max_tokens, keep_turns=True)
    return episodes, env


@pytest.fixture(scope="module")
def fp32_model():
    return tiny_model()


def test_model_tokens_are_their_turns_records_and_env_tokens_are_masked(fp32_model):
    episodes, env = _run(fp32_model)
    ro = episodes.rollout
    assert ro.num_rows == 6 and ro.params.n == 2
    assert int(episodes.tool_calls.sum()) > 0 and int(episodes.turns.max()) > 1  # some rows went on
    covered = torch.zeros(ro.completion_ids.shape, dtype=torch.bool)
    for record in episodes.turns_record:
        tb = record.batch
        for i, (r, col, keep) in enumerate(zip(record.rows, record.columns, record.kept)):
            # the turn's prompt is the episode's prompt + its history, token for token
            assert tb.sequence(i)[: tb.prompt_lengths[i]] == ro.sequence(r)[: ro.prompt_lengths[r] + col]
            span = slice(col, col + keep)
            assert torch.equal(ro.completion_ids[r, span], tb.completion_ids[i, :keep])
            for name in ("exit_steps", "logprobs", "tempered_logprobs", "kept_floor", "exit_logprobs"):
                assert torch.equal(getattr(ro, name)[r, span], getattr(tb, name)[i, :keep]), name
            assert torch.equal(ro.gate_probs[:, r, span].nan_to_num(-7.0), tb.gate_probs[:, i, :keep].nan_to_num(-7.0))
            assert not ro.env_mask[r, span].any()
            covered[r, span] = True
    env_tokens = ro.completion_mask & ~covered
    assert torch.equal(ro.env_mask, env_tokens)  # every other completion token is the environment's
    for r in range(ro.num_rows):
        written = ro.completion_ids[r][ro.env_mask[r]].tolist()
        assert written == list(ANSWER) * int(episodes.tool_calls[r]) or episodes.truncated[r]
    assert (ro.logprobs[ro.env_mask] == 0).all() and (ro.exit_steps[ro.env_mask] == 0).all()
    assert ro.gate_probs[:, ro.env_mask].isnan().all()
    assert torch.equal(ro.action_mask, ro.completion_mask & ~ro.env_mask)
    assert (ro.logprobs[ro.action_mask] < 0).all()
    assert int(ro.completion_lengths.max()) <= 30


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_replaying_the_turns_reproduces_the_episode_bitwise(fp32_model, schedule):
    episodes, _ = _run(fp32_model, schedule)
    replay = replay_episode(fp32_model, episodes)
    ro = episodes.rollout
    assert int(episodes.turns.max()) > 1
    assert torch.equal(replay.logprobs, ro.logprobs)
    assert torch.equal(replay.tempered_logprobs, ro.tempered_logprobs)
    assert torch.equal(replay.exit_logprobs, ro.exit_logprobs)


def test_bf16_replay_is_bitwise():
    model = tiny_model(dtype=torch.bfloat16)
    episodes, _ = _run(model, "deferred")
    replay = replay_episode(model, episodes)
    assert int(episodes.turns.max()) > 1
    assert torch.equal(replay.logprobs, episodes.rollout.logprobs)
    assert torch.equal(replay.tempered_logprobs, episodes.rollout.tempered_logprobs)
    assert torch.equal(replay.exit_logprobs, episodes.rollout.exit_logprobs)


def test_a_rerun_with_the_same_seeds_is_the_same_episode(fp32_model):
    a, _ = _run(fp32_model)
    b, _ = _run(fp32_model)
    for name in ("completion_ids", "exit_steps", "logprobs", "tempered_logprobs", "env_mask"):
        assert torch.equal(getattr(a.rollout, name), getattr(b.rollout, name)), name
    # another prompt seed changes that prompt's rows only
    c, _ = _run(fp32_model, prompt_seeds=[5, 99, 23])
    assert torch.equal(a.rollout.completion_ids[:2], c.rollout.completion_ids[:2])
    assert not torch.equal(a.rollout.completion_ids[2:4], c.rollout.completion_ids[2:4])


def test_limits_truncate_and_a_crash_costs_one_episode(fp32_model):
    short, _ = _run(fp32_model, max_turns=1)
    assert (short.turns == 1).all()
    # a row whose only turn called a tool is truncated (no turn left to read the answer)
    assert torch.equal(short.truncated, short.tool_calls.new_tensor(
        [("9" in decode(short.rollout.completion(r))) or short.rollout.finish_reasons[r] == "length"
         for r in range(6)], dtype=torch.bool))
    assert not short.rollout.env_mask.any()
    budget, _ = _run(fp32_model, max_tokens=8)
    assert int(budget.rollout.completion_lengths.max()) <= 8
    crash, env = _run(fp32_model, env=ScriptedEnv(ANSWER, crash_on=" 1"))
    assert 0 < len(crash.errors) < 6 and all("scripted crash" in m for m in crash.errors.values())
    for r in range(6):  # a crashed episode ends at the turn the environment crashed on; the others run on
        last_turn = crash.answers[r]
        assert (" 1" in last_turn and not crash.truncated[r]) == (r in crash.errors)
    assert crash.failed().tolist() == [r in crash.errors for r in range(6)]
