"""Partial rollouts (``orchestration.partial_rollouts``) with the vLLM engine, in process: the driver's
`PartialStep` continues every unfinished row as a new request whose prompt is its prompt plus its
tokens so far (vLLM's prefix cache serves that prefix's whole KV blocks while the weights are
unchanged — counted here — and a weights update drops it), and records exits and log-probs of the sampled tokens only, with each token's
weights version.

- Under one version, greedy rows continued in 2-token segments are the one-call rows (tokens and
  exits equal, log-probs within 1e-4: the prefix is computed in a prefill instead of decode passes).
- With new weights published after every segment, every segment of every trained row is the native
  engine's greedy continuation under the weights of the version it recorded (tokens and exits equal,
  log-probs within 1e-4, as vLLM's parity with the native engine) — a stale prefix cache would show.

vLLM here runs in the test's process (one engine for the module), not on a Ray rollout worker: the
step logic is the one a Ray driver runs, and the pool only shards its calls (tests/orchestration/ray/
test_partial_workers.py)."""

from __future__ import annotations

import pytest
import torch

from rltt.data.rewards import RewardRunner, WeightedReward
from rltt.orchestration.prompt_stream import PromptStream
from rltt.rollout.seeds import segment_seed
from rltt.orchestration.ray.partial_step import PartialStep
from rltt.rollout import NativeEngine
from tests.orchestration.ray.test_partial_rollouts import FakeLearner, recipe
from tests.vllm.helpers import ENGINE_OPTIONS, looped_model, needs_vllm, perturbed

pytestmark = [pytest.mark.heavy, pytest.mark.slow, needs_vllm]

K, SEGMENT, MAX_NEW = 2, 2, 8
MODEL = dict(num_loops=2, seed=0, tie_word_embeddings=False)
BLOCK, PROMPT = 32, 40  # KV blocks of 32 tokens (vLLM caches whole blocks), prompts of 40: one cached block


def version_weights(model, version: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()} if version == 0 else \
        perturbed(model, seed=version, scale=0.2)


class VersionedLearner(FakeLearner):
    """An update that ends after ``segments`` segments and publishes the model perturbed per version."""

    def __init__(self, model, segments: int):
        super().__init__(segments)
        self.model = model

    def rollout_state_dict(self):
        return self.version, version_weights(self.model, self.version)


def encode(text: str) -> list[int]:
    return [1 + ord(c) % 100 for c in (text * PROMPT)[:PROMPT]]


def prefix_hits(engine) -> int:
    """Prompt tokens vLLM found in its prefix cache so far."""
    return int(sum(metric.value for metric in engine.llm.get_metrics() if metric.name == "vllm:prefix_cache_hits"))


def _step(engine, learner, steps: int) -> PartialStep:
    r = recipe(K, steps, max_new=MAX_NEW)
    r.rollout.temperature, r.rollout.exit_policy, r.rollout.schedule = 0.0, "threshold:0.5", "dense"
    runner = RewardRunner([WeightedReward("length", lambda completion, answer, **kw: len(completion) / 20)])
    stream = PromptStream(r.data.source, encode, lambda q: q, seed=r.data.seed)
    return PartialStep(r, engine, learner, stream, runner, lambda ids: " ".join(map(str, ids)), [],
                       max_staleness=K, segment_tokens=SEGMENT, last_step=steps)


@pytest.fixture(scope="module")
def engine():
    from rltt.vllm.vllm_engine import VllmEngine

    built = VllmEngine(looped_model(**MODEL), **ENGINE_OPTIONS, block_size=BLOCK, disable_log_stats=False)
    yield built
    built.close()


def test_greedy_rows_continued_in_segments_are_the_one_call_rows(engine):
    assert engine.weights_version == 0
    step = _step(engine, FakeLearner(10**6), steps=2)
    step._admit()
    hits = prefix_hits(engine)
    while step.flight:
        step._tick()
    hits = prefix_hits(engine) - hits
    groups = sorted(step.done, key=lambda g: g.index)
    full = engine.generate([g.task.prompt_ids for g in groups],
                           step.sampling_base([g.seed for g in groups], step.group_size, MAX_NEW))
    rows = [row for g in groups for row in g.rows]
    assert len(rows) == full.num_rows == 8 and any(row.segments > 1 for row in rows)
    # a continued row's prompt starts with the block its previous segment left in the cache
    assert hits >= BLOCK * sum(row.segments - 1 for row in rows) > 0
    for j, row in enumerate(rows):
        n = int(full.completion_lengths[j])
        assert row.ids == full.completion_ids[j, :n].tolist() and row.finish == full.finish_reasons[j]
        assert row.segments == max(1, -(-n // SEGMENT))
        assert torch.equal(row.tensor("exit_steps"), full.exit_steps[j, :n])
        for name in ("logprobs", "exit_logprobs"):  # one per sampled token: none of the re-submitted prefix
            assert row.tensor(name).shape == (n,)
            torch.testing.assert_close(row.tensor(name), getattr(full, name)[j, :n], rtol=0, atol=1e-4)
        assert row.tensor("versions").tolist() == [0] * n


def test_each_segment_is_sampled_by_the_weights_of_its_version(engine):
    model = looped_model(**MODEL)
    learner = VersionedLearner(model, segments=1)
    learner.version = engine.weights_version  # the module's engine may serve version 0 or later
    steps = 3
    step = _step(engine, learner, steps)
    trained = []
    for n in range(1, steps + 1):
        step(n)
        trained += step.trained
    native = NativeEngine(looped_model(**MODEL))
    later = spanned = 0
    for g in trained:
        for j, row in enumerate(g.rows):
            spanned += row.versions_spanned() > 1
            for s, a in enumerate(range(0, len(row), SEGMENT)):
                version = int(row.tensor("versions")[a])
                assert len(set(row.tensor("versions")[a:a + SEGMENT].tolist())) == 1
                native.load_weights(version, version_weights(model, version))
                if s == 0:
                    out = native.generate([list(g.task.prompt_ids)],
                                          step.sampling_base([g.seed], step.group_size, SEGMENT))
                    r = j
                else:
                    out = native.generate([list(g.task.prompt_ids) + row.ids[:a]],
                                          step.sampling_base([segment_seed(g.seed, j, s)], 1,
                                                             min(SEGMENT, MAX_NEW - a)))
                    r = 0
                n = min(SEGMENT, len(row) - a)
                assert out.completion_ids[r, :n].tolist() == row.ids[a:a + n], (g.index, j, s, version)
                assert torch.equal(out.exit_steps[r, :n], row.tensor("exit_steps")[a:a + n])
                torch.testing.assert_close(out.logprobs[r, :n], row.tensor("logprobs")[a:a + n], rtol=0, atol=1e-4)
                later += version > 0
    assert later and spanned  # segments ran under published weights, rows spanned versions
    for version, batch in step.learner.batches:
        assert int((version - batch.versions[batch.target_mask]).max()) <= K
