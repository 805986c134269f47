"""`PartialStep` (``orchestration.partial_rollouts``) without a cluster: a deterministic engine and a
learner whose update takes a set number of segments drive the very step a Ray driver runs.

Rows continued across updates carry each token's version and the log-prob of the weights that
sampled it, and no trained token is more than K versions behind the learner; groups that fall
further behind are dropped whole, counted, and never trained on; a run resumed from the state a
checkpoint keeps (read back with ``weights_only=True``) trains and drops exactly what the
uninterrupted run did, so the prompt stream is neither skipped nor repeated; with one segment
per row, a partial rollout's rows are bitwise the one-call rollout's (the real native engine)."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
import torch

from rltt.data.rewards import RewardRunner, WeightedReward
from rltt.orchestration.prompt_stream import PromptStream
from rltt.orchestration.ray.partial_step import PartialStep
from rltt.rollout.seeds import mix64 as _splitmix64
from rltt.orchestration.train_recipe import TrainRecipe
from rltt.rollout import RolloutBatch, RolloutStats
from rltt.rollout.rollout_batch import Schedule
from rltt.telemetry import schema as m

STOP, LOOPS = 3, 2
LONG = 10  # prompts whose first token is LONG never stop early: they run to max_new_tokens


def token_logprob(version: int) -> float:
    """The fake engine's log-prob of every token it samples at ``version``."""
    return -0.5 * (version + 1)


class FakeEngine:
    """Deterministic rows: token k of row j of a prompt seeded s is a hash of (s, j, k); it stops
    with probability ~1/4 per token unless the prompt starts with LONG."""

    def __init__(self):
        self.weights_version = 0
        self.calls = []

    def load_weights(self, version, tensors):
        self.weights_version = version

    def generate(self, prompts, params):
        rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        width = params.max_new_tokens
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        lengths, reasons = [], []
        for r, (i, j) in enumerate(rows):
            n, reason = width, "length"
            for k in range(width):
                h = _splitmix64(params.prompt_seeds[i] * 7919 + j * 131 + k)
                if prompts[i][0] != LONG and h % 4 == 0:
                    ids[r, k], n, reason = STOP, k + 1, "stop"
                    break
                ids[r, k] = 10 + h % 40
            lengths.append(n)
            reasons.append(reason)
        lengths = torch.tensor(lengths)
        mask = torch.arange(width)[None, :] < lengths[:, None]
        lp = torch.where(mask, token_logprob(self.weights_version), 0.0)
        self.calls.append((len(prompts), params.n, self.weights_version))
        return RolloutBatch(
            prompts=[list(p) for p in prompts], prompt_index=torch.tensor([i for i, _ in rows]),
            prompt_lengths=torch.tensor([len(prompts[i]) for i, _ in rows]), completion_ids=ids * mask,
            completion_lengths=lengths, completion_mask=mask, exit_steps=mask.long() * 2, logprobs=lp,
            tempered_logprobs=lp, gate_probs=torch.full((LOOPS, len(rows), width), 0.5), finish_reasons=reasons,
            schedule=Schedule("fake", [], replayable=False), params=params,
            stats=RolloutStats(tokens=int(lengths.sum())), num_loops=LOOPS, dtype=torch.float32)


class FakeLearner:
    """An update that finishes after ``segments`` polls (the segments generated meanwhile)."""

    def __init__(self, segments: int):
        self.segments, self.version, self.during_update, self.last_update_s = segments, 0, None, 0.0
        self.batches, self._left = [], None

    def update(self, batch):
        self.batches.append((self.version, batch))
        self._left = self.segments
        if self.during_update is not None:
            self.during_update()
        self.poll_update(wait=True)
        return {"loss/total": 0.0}

    def poll_update(self, wait: bool = False) -> bool:
        if self._left is None:
            return True
        if self._left > 0 and not wait:
            self._left -= 1
            return False
        self._left, self.version = None, self.version + 1
        return True

    def rollout_state_dict(self):
        return self.version, {}


def encode(text: str) -> list[int]:
    return [LONG if len(text) % 5 == 0 else 11] + [10 + ord(c) % 40 for c in text[:6]]


@pytest.fixture
def runner():
    return RewardRunner([WeightedReward("length", lambda completion, answer, **kw: len(completion) / 20)])


def recipe(K: int, steps: int, max_new: int = 12, segment: int = 4) -> TrainRecipe:
    r = TrainRecipe()
    r.rollout.prompts_per_step, r.rollout.group_size, r.rollout.max_new_tokens = 2, 2, max_new
    r.data.source = "synthetic:easy"
    r.orchestration.backend, r.orchestration.max_staleness, r.orchestration.partial_rollouts = "ray", K, True
    r.train.steps = steps
    return r


def make_step(r: TrainRecipe, runner, segments: int, engine=None, learner=None):
    prompts = PromptStream(r.data.source, encode, lambda q: q, seed=r.data.seed)
    engine = engine or FakeEngine()
    learner = learner or FakeLearner(segments)
    step = PartialStep(r, engine, learner, prompts, runner, lambda ids: " ".join(map(str, ids)), [STOP],
                       max_staleness=r.orchestration.max_staleness, segment_tokens=4, last_step=r.train.steps)
    return step


def run(step, first: int, last: int) -> list[dict]:
    """Steps ``first`` … ``last``; per step its metrics, the stream positions it trained on and dropped."""
    out = []
    for n in range(first, last + 1):
        metrics = step(n)
        out.append({"metrics": metrics, "trained": [g.task.index for g in step.trained],
                    "dropped": [g.task.index for g in step.last_dropped]})
    return out


def test_partial_rows_carry_per_token_versions_within_K(runner):
    K = 2
    step = make_step(recipe(K, 8, max_new=16), runner, segments=1)
    records = run(step, 1, 8)
    partial = 0
    for (version, batch), rec in zip(step.learner.batches, records):
        keep = batch.target_mask
        versions = batch.versions[keep]
        assert bool((versions >= 0).all()) and bool((batch.versions[~keep] == -1).all())
        behind = version - versions
        assert int(behind.max()) <= K
        assert rec["metrics"][m.ORCH_STALENESS] == int(behind.max())
        assert rec["metrics"][m.ORCH_STALENESS_MEAN] == pytest.approx(float(behind.float().mean()))
        # every token's behaviour log-prob is the one of the weights that sampled it
        want = torch.tensor([token_logprob(int(v)) for v in versions])
        assert torch.equal(batch.sampler_logprobs[keep], want)
        spans = [len(set(batch.versions[r][batch.target_mask[r]].tolist())) for r in range(batch.size)]
        assert rec["metrics"][m.ORCH_PARTIAL_ROWS] == sum(s > 1 for s in spans)
        partial += rec["metrics"][m.ORCH_PARTIAL_ROWS]
        assert 0.0 <= rec["metrics"][m.ORCH_LEARNER_IDLE_FRAC] <= 1.0
        assert 0.0 <= rec["metrics"][m.ORCH_ROLLOUT_IDLE_FRAC] <= 1.0
    assert partial > 0  # rows did continue under newer weights
    assert step.engine.weights_version == step.learner.version == 8


def _accounting(step, records):
    trained = [i for rec in records for i in rec["trained"]]
    dropped = [i for rec in records for i in rec["dropped"]] + [g.task.index for g in step.dropped]
    held = [g.task.index for g in step.flight + step.done]
    return trained, dropped, held


def test_groups_behind_by_more_than_K_are_dropped_counted_and_never_trained(runner):
    K = 2
    step = make_step(recipe(K, 10, max_new=32), runner, segments=1)
    records = run(step, 1, 10)
    trained, dropped, held = _accounting(step, records)
    assert dropped, "the long prompts' groups fall behind and are dropped"
    assert not set(dropped) & set(trained)
    assert sum(rec["metrics"][m.ORCH_DROPPED_ROWS] for rec in records) == \
        2 * sum(len(rec["dropped"]) for rec in records)  # every row of each dropped group
    # every prompt the stream handed out is trained on, dropped or still held, exactly once
    assert sorted(trained + dropped + held) == list(range(step.prompts.position))
    for version, batch in step.learner.batches:
        assert int((version - batch.versions[batch.target_mask]).max()) <= K


def _checkpointed(step) -> dict:
    """The loop's part of a checkpoint through torch.save / torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save({"prompts": step.prompts.state_dict(), **step.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_a_resumed_run_trains_and_drops_what_the_uninterrupted_one_did(runner):
    K, steps = 2, 9
    want = run(make_step(recipe(K, steps, max_new=32), runner, segments=1), 1, steps)
    first = make_step(recipe(K, steps, max_new=32), runner, segments=1)
    got = run(first, 1, 4)
    state = _checkpointed(first)
    engine, learner = FakeEngine(), FakeLearner(1)
    learner.version = engine.weights_version = first.learner.version  # the learner's checkpoint, then the sync
    resumed = make_step(recipe(K, steps, max_new=32), runner, segments=1, engine=engine, learner=learner)
    resumed.prompts.load_state_dict(state["prompts"])
    resumed.load_state_dict(state)
    got += run(resumed, 5, steps)
    assert [(r["trained"], r["dropped"]) for r in got] == [(r["trained"], r["dropped"]) for r in want]
    assert any(r["dropped"] for r in want)
    for key in (m.ORCH_STALENESS, m.ORCH_STALENESS_MEAN, m.ORCH_PARTIAL_ROWS, m.ORCH_DROPPED_ROWS, m.REWARD_MEAN):
        assert [r["metrics"][key] for r in got] == [r["metrics"][key] for r in want], key


# -- the real native engine: continuing a row re-submits its tokens as the prompt ---------------

@pytest.fixture(scope="module")
def native(tmp_path_factory):
    from rltt.orchestration.policy import load_policy
    from rltt.rollout import NativeEngine

    from ..helpers import tiny_checkpoint

    model, tok = load_policy(tiny_checkpoint(tmp_path_factory.mktemp("partial") / "policy"))
    return NativeEngine(model), tok


class NoEos:
    """The engine, sampling past the end-of-sequence token (the tiny model's greedy rows end at once)."""

    weights_version = 0

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, params):
        return self.engine.generate(prompts, replace(params, ignore_eos=True))


def _segmented(native, runner, segment: int, temperature: float, max_new: int = 10, steps: int = 1,
               wrap=lambda engine: engine, thinking=None):
    """The groups of the first ``steps`` steps' prompts generated segment by segment at version 0
    (the learner never finishes), and the one-call rollout of those groups."""
    engine, tok = native
    engine = wrap(engine)
    r = recipe(2, steps, max_new=max_new)
    r.rollout.temperature, r.rollout.exit_policy = temperature, "threshold:0.5"
    step = PartialStep(r, engine, FakeLearner(10**6), PromptStream(r.data.source, lambda s: tok(
        s, add_special_tokens=False).input_ids, lambda q: q, seed=r.data.seed), runner, tok.decode, [],
        max_staleness=2, segment_tokens=segment, last_step=steps, thinking=thinking)
    step._admit()
    ticks = 0
    while step.flight:
        step._tick()
        ticks += 1
    groups = sorted(step.done, key=lambda g: g.index)
    full = engine.generate([g.task.prompt_ids for g in groups],  # the batch the first segment ran
                           replace(step.sampling_base([g.seed for g in groups], r.rollout.group_size, max_new),
                                   thinking=thinking))
    return step, groups, full, ticks


def test_with_one_segment_a_partial_rollout_is_the_one_call_rollout(native, runner):
    from rltt.orchestration.ray.partial_rows import group_batch
    from rltt.orchestration.ray.shards import merge

    step, groups, full, ticks = _segmented(native, runner, segment=10, temperature=1.0)
    assert ticks == 1 and len(groups) == 2  # the last step's prompts only
    got = merge([group_batch(g, full.params, full.num_loops, full.dtype, full.pad_id, full.schedule.kind)
                 for g in groups], full.params, 0.0)
    for name in ("prompt_index", "completion_ids", "completion_lengths", "exit_steps", "logprobs",
                 "tempered_logprobs", "exit_logprobs", "kept_floor"):
        assert torch.equal(getattr(got, name), getattr(full, name)), name
    assert torch.equal(got.gate_probs.isnan(), full.gate_probs.isnan())
    assert torch.equal(got.gate_probs.nan_to_num(), full.gate_probs.nan_to_num())
    assert got.finish_reasons == full.finish_reasons and bool((got.versions[got.completion_mask] == 0).all())


def test_a_greedy_row_continued_in_segments_is_the_one_call_row(native, runner):
    """Segments of 2 tokens re-prefill the tokens so far: the same greedy tokens and exits, and the
    same log-probs up to float rounding (the prefix's states are computed in a prefill instead of
    decode passes)."""
    step, groups, full, ticks = _segmented(native, runner, segment=2, temperature=0.0, steps=2, wrap=NoEos)
    assert len(groups) == 4 and ticks == 5  # 10 tokens
    rows = [row for g in groups for row in g.rows]
    for j, row in enumerate(rows):
        n = int(full.completion_lengths[j])
        assert row.ids == full.completion_ids[j, :n].tolist()
        assert row.segments == max(1, -(-n // 2))
        assert torch.equal(row.tensor("exit_steps"), full.exit_steps[j, :n])
        torch.testing.assert_close(row.tensor("logprobs"), full.logprobs[j, :n], rtol=0, atol=1e-5)


def test_a_stop_string_spanning_two_segments_ends_the_row_there():
    from rltt.orchestration.ray.partial_rows import PartialRow
    from rltt.rollout.rows import token_bytes
    from rltt.rollout import SamplingParams

    engine = FakeEngine()
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    first = engine.generate([[LONG, 12]], SamplingParams(max_new_tokens=4, prompt_seeds=[5]))
    second = engine.generate([[LONG, 12, *first.completion(0)]], SamplingParams(max_new_tokens=4, prompt_seeds=[6]))
    a, b = first.completion(0), second.completion(0)
    for stop, length, finish in ((f"{a[-1]} {b[0]}", 5, "stop"), (f"{b[1]} {b[2]}", 7, "stop"), ("no such", 8, None)):
        params = SamplingParams(max_new_tokens=12, stop_strings=[stop], decoder=decode)
        row = PartialRow()
        row.append_segment(first, 0, 0, 4, params)
        row.append_segment(second, 0, 1, 4, params)
        assert (len(row), row.finish) == (length, finish), stop
        assert row.ids == (a + b)[:length] and row.tensor("versions").tolist() == [0] * 4 + [1] * (length - 4)
        assert row.tensor("gate_probs").shape == (length, LOOPS)
        assert row.nbytes() == length * token_bytes(LOOPS) == length * (46 + 4 * LOOPS)


def test_a_thinking_budget_is_counted_across_a_rows_segments(native, runner):
    """Greedy rows in 3-token segments with a thinking budget of 4 that is never closed: each row's
    segment ends at the budget, the interruption is forced there and 3 answer tokens follow — the
    one-call rollout with that budget (forced tokens not sampled, rows longer than max_new_tokens)."""
    from rltt.rollout.params import ThinkingBudget

    thinking = ThinkingBudget(budget=4, close=[1, 2, 3], interruption=[5, 6, 1, 2, 3], answer_budget=3)
    step, groups, full, ticks = _segmented(native, runner, segment=3, temperature=0.0, max_new=8, steps=2,
                                           wrap=NoEos, thinking=thinking)
    assert int(full.forced_mask.sum()) == 4 * 2 * 5 and int(full.completion_lengths.max()) == 12 > 8
    rows = [row for g in groups for row in g.rows]
    for j, row in enumerate(rows):
        n = int(full.completion_lengths[j])
        assert row.ids == full.completion_ids[j, :n].tolist() and row.finish == full.finish_reasons[j]
        assert torch.equal(row.tensor("forced_mask"), full.forced_mask[j, :n])
        assert row.segments == 3  # 3 + 1 thinking tokens, then the forced ids and 3 answer tokens
        assert torch.equal(row.tensor("exit_steps"), full.exit_steps[j, :n])
        torch.testing.assert_close(row.tensor("logprobs"), full.logprobs[j, :n], rtol=0, atol=1e-5)
        assert bool(row.tensor("gate_probs")[row.tensor("forced_mask")].isnan().all())
    from rltt.orchestration.ray.partial_rows import group_batch

    batch = group_batch(groups[0], replace(full.params, thinking=thinking), full.num_loops, full.dtype,
                        full.pad_id, full.schedule.kind)
    assert torch.equal(batch.forced_mask, full.forced_mask[:2, :batch.forced_mask.shape[1]])
    scored, metrics = step._scored(groups)  # the learner's rows: forced tokens are input, never targets
    assert int(scored.batch.target_mask.sum()) == int(full.completion_lengths.sum()) - int(full.forced_mask.sum())
    assert metrics[m.LENGTH_FORCED_FRAC] == 1.0  # the thinking metrics, every row forced


@pytest.mark.parametrize("close, positions, want", [
    ("open", None, ("forced", 4 + 2 + 3)),  # the interruption (2 ids), then answer_budget 3
    ("closed", None, ("none", 12)),  # closed in time: on to max_new_tokens
    ("open", 5, ("length", 4)),  # room 5 - 4 + 1 = 2 (the engines' count): not more than the interruption
])
def test_the_forced_answer_rule_across_segments(close, positions, want):
    from rltt.orchestration.ray.partial_rows import PartialRow
    from rltt.rollout import SamplingParams
    from rltt.rollout.params import ThinkingBudget

    engine = FakeEngine()
    first = engine.generate([[LONG, 12]], SamplingParams(max_new_tokens=2, prompt_seeds=[5]))
    second = engine.generate([[LONG, 12, 1]], SamplingParams(max_new_tokens=2, prompt_seeds=[6]))
    a, b = first.completion(0), second.completion(0)
    closing = [b[0]] if close == "closed" else [99]
    thinking = ThinkingBudget(budget=4, close=closing, interruption=[7, 99], answer_budget=3)
    params = SamplingParams(max_new_tokens=12)
    row = PartialRow()
    assert row.limit(params, thinking) == 4
    row.append_segment(first, 0, 0, 2, params, thinking, positions)
    assert row.finish is None and row.limit(params, thinking) == 4
    row.append_segment(second, 0, 1, 2, params, thinking, positions)
    kind, cap = want
    forced = row.tensor("forced_mask").tolist()
    if kind == "length":
        assert row.finish == "length" and len(row) == 4 and not any(forced)
        return
    assert row.finish is None and row.limit(params, thinking) == cap
    if kind == "forced":
        assert row.ids == a + b + [7, 99] and forced == [False] * 4 + [True] * 2
        assert row.tensor("logprobs")[4:].tolist() == [0.0, 0.0] and row.tensor("versions").tolist() == [0, 0, 1, 1, 1, 1]
        assert bool(row.tensor("gate_probs")[4:].isnan().all()) and row.nbytes() == len(row) * (46 + 4 * LOOPS)
    else:
        assert row.ids == a + b and not any(forced)


class KLLearner(FakeLearner):
    """`FakeLearner` with a sequence KL: 0.1 · (row + 1) per row, recording when it was asked."""

    def __init__(self, segments: int):
        super().__init__(segments)
        self.asked = []  # (learner version, whether an update was in flight, rows)

    def sequence_kl(self, batch):
        self.asked.append((self.version, self._left is not None, batch.size))
        return 0.1 * (torch.arange(batch.size, dtype=torch.float32) + 1)


def test_the_kl_in_the_reward_is_measured_between_updates(runner):
    from rltt.objectives.advantages import group_advantages

    r = recipe(2, 4, max_new=12)
    r.algorithm.kl_in, r.algorithm.kl_coef = "reward", 0.5
    step = make_step(r, runner, segments=1, learner=KLLearner(1))
    formed = []
    scored = step._scored

    def recording(take):
        groups, metrics = scored(take)
        formed.append(groups)
        return groups, metrics

    step._scored = recording
    run(step, 1, 4)
    G = r.rollout.group_size
    assert [(v, busy) for v, busy, _ in step.learner.asked] == [(v, False) for v, _ in step.learner.batches]
    for groups, (_, batch) in zip(formed, step.learner.batches):
        penalty = 0.5 * 0.1 * (torch.arange(groups.rewards.numel(), dtype=torch.float32) + 1)
        want = group_advantages(groups.rewards.float() - penalty, G, r.algorithm.advantage_scale,
                                estimator=r.algorithm.advantage).advantages.float()
        assert torch.equal(batch.advantages, want)
        plain = group_advantages(groups.rewards.float(), G, r.algorithm.advantage_scale,
                                 estimator=r.algorithm.advantage).advantages.float()
        assert not torch.equal(batch.advantages, plain)  # the penalty changed them
