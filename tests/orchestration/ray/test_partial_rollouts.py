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

import pytest
import torch

from rltt.data.rewards import RewardRunner, WeightedReward
from rltt.orchestration.prompt_stream import PromptStream
from rltt.orchestration.ray.partial_step import PartialStep
from rltt.orchestration.step import _splitmix64
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
