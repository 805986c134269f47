"""Partial rollouts (``orchestration.partial_rollouts``) on two rollout workers of the session's Ray
cluster: every segment call is sharded over the workers, every unfinished row is continued exactly
once per segment, and the rows are bitwise those of the same step on one in-process engine (running
each call as the same shards: a batch's composition changes the last bits of a log-prob).

The learner publishes real, different weights at every version (the base model perturbed), and an
update ends after one segment, so rows span versions; each token's recorded version is checked
against the weights that sampled it: every segment of every row is sampled again on a local engine
holding that version's weights (its prompt plus the row's tokens before it, its segment seed) and
gives the same tokens, exits and log-probs."""

from __future__ import annotations

import pytest
import torch

from rltt.data.rewards import RewardRunner, WeightedReward
from rltt.orchestration.components import make_engine
from rltt.orchestration.policy import load_policy
from rltt.orchestration.prompt_stream import PromptStream
from rltt.orchestration.orchestration_section import RaySection
from rltt.rollout.seeds import segment_seed
from rltt.orchestration.ray.partial_step import PartialStep
from rltt.rollout import NativeEngine

from ..helpers import tiny_checkpoint
from .test_partial_rollouts import FakeLearner, recipe
from .test_rollout_pool import builder, one_thread, shardwise

pytestmark = [pytest.mark.heavy, pytest.mark.slow]

K, STEPS, MAX_NEW, SEGMENT, WORKERS = 2, 3, 7, 3, 2


def version_weights(base: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """The weights the learner publishes as ``version``: 0 the model's own, then perturbed."""
    if version == 0:
        return {k: v.clone() for k, v in base.items()}
    g = torch.Generator().manual_seed(version)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
            for k, v in base.items()}


class VersionedLearner(FakeLearner):
    """`FakeLearner` (an update ends after one segment) publishing different weights per version."""

    def __init__(self, base):
        super().__init__(segments=1)
        self.base = base

    def rollout_state_dict(self):
        return self.version, version_weights(self.base, self.version)


class Shardwise:
    """The local engine running each call as the pool's shards (the rounding of the same batches)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        return shardwise(self.engine, prompts, params, WORKERS)


class RecordingCalls:
    """An engine wrapper recording, per `submit`, the shards it was split into."""

    def __init__(self, pool):
        self.pool, self.shards = pool, []

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def submit(self, prompts, params):
        pending = self.pool.submit(prompts, params)
        self.shards.append([(p.worker, p.start, p.end) for p in pending.parts])
        return pending


def _recipe():
    r = recipe(K, STEPS, max_new=MAX_NEW)
    r.rollout.temperature, r.rollout.exit_policy = 1.0, "threshold:0.5"
    return r


def _step(r, engine, tok, base):
    stream = PromptStream(r.data.source, lambda s: tok(s, add_special_tokens=False).input_ids, lambda q: q,
                          seed=r.data.seed)
    runner = RewardRunner([WeightedReward("length", lambda completion, answer, **kw: len(completion) / 20)])
    return PartialStep(r, engine, VersionedLearner(base), stream, runner, tok.decode, [tok.eos_token_id],
                       max_staleness=K, segment_tokens=SEGMENT, last_step=STEPS)


def _run(step) -> list:
    """Every group trained, step by step, and the learner's batches."""
    trained = []
    for n in range(1, STEPS + 1):
        step(n)
        trained.append(list(step.trained))
    return trained


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    from rltt.orchestration.ray.rollout_pool import RayRolloutPool

    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("partial-workers") / "policy")
    r = _recipe()
    r.model.path = str(ckpt)
    model, tok = load_policy(ckpt)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pool = RayRolloutPool(builder(ckpt), RaySection(rollout_workers=WORKERS, timeout_s=120))
    try:
        spread = _step(r, RecordingCalls(pool), tok, base)
        got = _run(spread)
        reloads = pool.reloads
    finally:
        pool.close()
    local = make_engine(r, load_policy(ckpt)[0])
    want_step = _step(r, Shardwise(local), tok, base)
    want = one_thread(lambda: _run(want_step))  # the workers run torch on one thread
    return spread, got, want_step, want, reloads, ckpt, tok


def test_segments_are_sharded_and_every_row_continued_once_per_segment(runs):
    spread, got, _, _, reloads, _, _ = runs
    calls = spread.engine.shards
    assert any(len({w for w, _, _ in call}) == WORKERS for call in calls)  # calls split over both workers
    for call in calls:  # contiguous shards covering the call's prompts once, one per worker
        assert [w for w, _, _ in call] == list(range(len(call)))
        assert all(a < b for _, a, b in call) and all(call[i][2] == call[i + 1][1] for i in range(len(call) - 1))
    assert reloads == 0  # every worker had loaded each version before its next shard
    rows = [row for groups in got for g in groups for row in g.rows]
    assert any(row.versions_spanned() > 1 for row in rows)
    for row in rows:  # one segment per SEGMENT tokens: a row never ran twice (nor skipped) in a tick
        assert row.segments == max(1, -(-len(row) // SEGMENT))
        v = row.tensor("versions")
        assert all(len(set(v[a:a + SEGMENT].tolist())) == 1 for a in range(0, len(row), SEGMENT))


def test_two_workers_train_on_the_rows_of_one_engine(runs):
    spread, got, want_step, want, _, _, _ = runs
    assert [[g.task.index for g in s] for s in got] == [[g.task.index for g in s] for s in want]
    for groups, wanted in zip(got, want):
        for g, w in zip(groups, wanted):
            assert g.first_version == w.first_version
            for row, ref in zip(g.rows, w.rows):
                assert row.finish == ref.finish and row.segments == ref.segments
                for name, value in ref.values.items():  # every field; NaN gates where the last loop has none
                    assert row.values[name].tobytes() == value.tobytes(), name
    for (version, batch), (v, b) in zip(spread.learner.batches, want_step.learner.batches):
        assert version == v
        assert torch.equal(batch.versions, b.versions) and torch.equal(batch.sampler_logprobs, b.sampler_logprobs)
        assert int((version - batch.versions[batch.target_mask]).max()) <= K


def test_each_token_is_sampled_by_the_weights_of_its_version(runs):
    spread, got, _, _, _, ckpt, tok = runs
    engine = NativeEngine(load_policy(ckpt)[0])
    base = spread.learner.base
    checked = 0
    for groups in got:
        for g in groups:
            for j, row in enumerate(g.rows):
                for s, a in enumerate(range(0, len(row), SEGMENT)):
                    version = int(row.tensor("versions")[a])
                    engine.load_weights(version, version_weights(base, version))
                    if s == 0:
                        params = spread.sampling_base([g.seed], len(g.rows), min(SEGMENT, MAX_NEW))
                        out, r = engine.generate([list(g.task.prompt_ids)], params), j
                    else:
                        params = spread.sampling_base([segment_seed(g.seed, j, s)], 1,
                                                      min(SEGMENT, MAX_NEW - a))
                        out, r = engine.generate([list(g.task.prompt_ids) + row.ids[:a]], params), 0
                    n = min(SEGMENT, len(row) - a)
                    assert out.completion_ids[r, :n].tolist() == row.ids[a:a + n], (g.index, j, s)
                    assert torch.equal(out.exit_steps[r, :n], row.tensor("exit_steps")[a:a + n])
                    torch.testing.assert_close(out.logprobs[r, :n], row.tensor("logprobs")[a:a + n],
                                               rtol=0, atol=1e-5)
                    checked += int(version > 0)
    assert checked  # segments sampled at later versions were among them
