"""Native-engine episodes continue their rows: each row's KV cache and decode state live on between
turns (`rltt.rollout.continuation`), only the appended environment tokens are prefilled.

The contract tested here: the episode batch carries the pass record of every turn and replays bit
for bit as one batch (fp32 dense and deferred, bf16); the learner's teacher-forced scores at the
rollout weights are the sampler's to rounding (< 1e-4) and the hybrid log-prob is the sampler's
exactly (ratio exactly 1); against re-submitting the history as a new prompt (any engine's
default) the tokens and exits are the same with the same seeds and the log-probs agree to
rounding — not bitwise, the history's KV being computed in other passes — while the history is
not recomputed; the KV held across turns is one chunk's rows × (longest prompt + the episode's
token budget), the memory plan's ``rollout_kv`` term."""

from types import SimpleNamespace

import pytest
import torch

from rltt.errors import RlttError
from rltt.objectives import hybrid_logprob
from rltt.orchestration.episodes import replay_episode, run_episodes
from rltt.planning import rollout_memory as rm
from rltt.planning.run_settings import completion_width
from rltt.planning.shapes import ModelShape
from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs
from rltt.rollout.turns import ResubmitTurns

from tests.rollout.helpers import dense_logprobs, prompts, tiny_model

from .helpers import ScriptedEnv, decode, encode

SIZES, SEEDS, MAX_TOKENS = [4, 6, 3], [5, 17, 23], 30


class ResubmittingEngine(NativeEngine):
    """The native engine with every engine's default turns: the history re-submitted as a prompt."""

    def open_turns(self, prompts, params, max_tokens):
        yield ResubmitTurns(self, prompts, params)


def _params(schedule="deferred", **kw):
    fields = dict(temperature=1.0, top_k=40, max_new_tokens=6, n=2, prompt_seeds=SEEDS,
                  stop_token_ids=[5, 6, 7, 8, 10], exit_policy="sample", schedule=schedule)
    fields.update(kw)
    return SamplingParams(**fields)


def _run(engine, schedule="deferred", max_turns=4, **kw):
    return run_episodes(engine, prompts(SIZES, seed=2), _params(schedule, **kw), ScriptedEnv(), ["a", "b", "c"],
                        encode, decode, max_turns=max_turns, max_tokens=MAX_TOKENS, keep_turns=True)


@pytest.fixture(scope="module")
def fp32_model():
    return tiny_model()


def _assert_replays_bitwise(model, episodes):
    ro = episodes.rollout
    assert ro.schedule.replayable and int(episodes.turns.max()) > 2  # rows went on for several turns
    replayed = replay_logprobs(model, ro)  # the episode batch itself, as one batch of rows
    model_tokens = ro.action_mask
    for name, got in (("logprobs", replayed.logprobs), ("tempered_logprobs", replayed.tempered_logprobs),
                      ("exit_logprobs", replayed.exit_logprobs)):
        assert torch.equal(got[model_tokens], getattr(ro, name)[model_tokens]), name
    again = replay_episode(model, episodes)
    for name in ("logprobs", "tempered_logprobs", "exit_logprobs"):
        assert torch.equal(getattr(again, name), getattr(ro, name)), name


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_a_continued_episode_replays_bitwise_as_one_batch(fp32_model, schedule):
    _assert_replays_bitwise(fp32_model, _run(NativeEngine(fp32_model), schedule))


def test_bf16_continued_episode_replays_bitwise():
    model = tiny_model(dtype=torch.bfloat16)
    _assert_replays_bitwise(model, _run(NativeEngine(model), "deferred"))


def test_chunked_sessions_one_at_a_time_replay_bitwise(fp32_model):
    engine = NativeEngine(fp32_model, chunk_rows=2)  # one prompt (n = 2 rows) per session
    live = []
    opened = engine.open_turns

    def watched(prompts, params, max_tokens):
        for session in opened(prompts, params, max_tokens):
            assert all(s.closed for s in live)  # the previous chunk's KV is gone before the next opens
            live.append(session)
            yield session

    engine.open_turns = watched
    episodes = _run(engine, "deferred")
    assert len(live) == 3 and episodes.rollout.schedule.chunks is not None
    assert [(s.first_row, s.end_row) for s in live] == [(0, 2), (2, 4), (4, 6)]
    _assert_replays_bitwise(fp32_model, episodes)


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_the_learner_scores_a_continued_episode_as_sampled(fp32_model, schedule):
    """Teacher-forced over the whole episode (prompt, turns, answers) at the rollout weights: the
    sampler's log-probs to rounding, and the hybrid log-prob the sampler's exactly (ratio 1)."""
    ro = _run(NativeEngine(fp32_model), schedule).rollout
    mask = ro.action_mask
    dense = dense_logprobs(fp32_model, ro, temperature=1.0, truncated=True)
    assert (dense.exit.detach() - ro.tempered_logprobs)[mask].abs().max() < 1e-4
    hybrid = hybrid_logprob(dense.exit.detach(), ro.tempered_logprobs).masked_fill(~mask, 0.0)
    assert torch.equal(hybrid, ro.tempered_logprobs.masked_fill(~mask, 0.0))


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_continued_and_resubmitted_turns_sample_the_same_episode(fp32_model, schedule):
    continued = _run(NativeEngine(fp32_model), schedule)
    resubmitted = _run(ResubmittingEngine(fp32_model), schedule)
    a, b = continued.rollout, resubmitted.rollout
    assert not b.schedule.replayable  # re-submitted turns: each turn's batch is its own record
    for name in ("completion_ids", "exit_steps", "env_mask", "kept_floor"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(continued.turns, resubmitted.turns) and int(continued.turns.max()) > 2
    # the same draws; the history's KV computed in other passes: equal to rounding, not bitwise
    assert (a.logprobs - b.logprobs).abs().max() < 1e-5
    # turn 1 is the same engine call either way, bit for bit
    first_a, first_b = continued.turns_record[0].batch, resubmitted.turns_record[0].batch
    for name in ("completion_ids", "logprobs", "tempered_logprobs", "exit_logprobs"):
        assert torch.equal(getattr(first_a, name), getattr(first_b, name)), name
    # no two rows share a history here: the same serial passes (a turn's prefill rides on its first
    # token's passes either way), but the continued rows never recompute their history
    assert a.stats.passes == b.stats.passes
    assert a.stats.entries_computed < b.stats.entries_computed


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_rows_sharing_a_history_take_no_shared_prefill_when_continued(fp32_model, schedule):
    """Greedy tokens and exits: a prompt's two rows are the same episode. Re-submitted, their equal
    histories are prefilled once for both (`shared_prefill`): T serial passes before the turn's
    first token, in every later call that holds such a pair; continued, no pass is added."""
    kw = dict(temperature=0.0, exit_policy="threshold:0.5")
    continued = _run(NativeEngine(fp32_model), schedule, **kw)
    resubmitted = _run(ResubmittingEngine(fp32_model), schedule, **kw)
    a, b = continued.rollout, resubmitted.rollout
    assert torch.equal(a.completion_ids, b.completion_ids)
    shared_calls = sum(len({tuple(p) for p in record.batch.prompts}) < record.batch.num_rows
                       for record in resubmitted.turns_record[1:])
    assert shared_calls > 0
    assert b.stats.passes - a.stats.passes == a.num_loops * shared_calls
    assert b.stats.passes_per_token > a.stats.passes_per_token


def test_the_kv_held_across_turns_is_the_plans_rollout_kv(fp32_model):
    """One chunk's rows × (longest prompt + the episode's token budget): what ``rollout_kv`` counts
    for an episode recipe (`completion_width`: ``env.max_tokens`` when longer than a turn)."""
    engine = NativeEngine(fp32_model)
    params = _params().validate()
    sessions = engine.open_turns(prompts(SIZES, seed=2), params, MAX_TOKENS)
    session = next(sessions)
    session.first()
    rollout = SimpleNamespace(max_new_tokens=params.max_new_tokens, thinking=SimpleNamespace(budget=0))
    env = SimpleNamespace(enabled=True, max_tokens=MAX_TOKENS)
    positions = max(SIZES) + completion_width(rollout, env)
    shape = ModelShape.of(fp32_model.config)
    assert session.held_bytes() == rm.kv_bytes(shape, len(SIZES) * params.n, positions, 4)
    session.release(list(range(len(SIZES) * params.n)))
    assert session.held_bytes() == 0  # every episode ended: the executor went
    sessions.close()


def test_a_continuation_that_does_not_extend_the_row_is_refused(fp32_model):
    engine = NativeEngine(fp32_model)
    params = _params().validate()
    sessions = engine.open_turns(prompts(SIZES, seed=2), params, MAX_TOKENS)
    session = next(sessions)
    batch = session.first()
    seq = batch.sequence(0)
    call = SamplingParams(**{**params.__dict__, "n": 1, "seed": None, "prompt_seeds": [1]})
    with pytest.raises(RlttError, match="does not extend"):
        session.next([0], [[seq[0] + 1] + seq[1:] + [11]], [3], call)
    with pytest.raises(RlttError, match="asks for"):
        session.next([0], [seq + [11]], [MAX_TOKENS], call)
    with pytest.raises(RlttError, match="keeps its session's"):
        session.next([0], [seq + [11]], [3], SamplingParams(**{**call.__dict__, "schedule": "dense"}))
    session.release([0])
    with pytest.raises(RlttError, match="not a live row"):
        session.next([0], [seq + [11]], [3], call)
    sessions.close()


def test_the_episode_counts_the_sessions_pending_work_once(fp32_model):
    engine = NativeEngine(fp32_model)
    episodes = _run(engine, "deferred")
    # the turns' reports add up to what the scheduler holds pending at the end: replay the record's
    # work and count the (token, step) entries it left uncomputed
    ro = episodes.rollout
    computed = {}
    for record in ro.schedule.passes:
        for r, s, e, step in record.work.tolist():
            computed.setdefault((r, step), set()).update(range(s, e + 1))
        if record.fork is not None:
            for src, dst, n in record.fork.tolist():
                for step in range(1, ro.num_loops + 1):
                    computed.setdefault((dst, step), set()).update(range(n))
    pending = 0
    for r in range(ro.num_rows):
        last = int(ro.prompt_lengths[r]) + int(ro.completion_lengths[r]) - 2  # the last decode position
        for step in range(1, ro.num_loops + 1):
            pending += sum(p not in computed.get((r, step), set()) for p in range(last + 1))
    assert ro.stats.entries_pending == pending > 0
