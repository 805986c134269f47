"""Partial rollouts (``orchestration.partial_rollouts``) with the vLLM engine on a Ray rollout worker
(one engine, built in the actor by the local loop's factory for ``rollout.engine: vllm``).

The learner publishes different weights after every segment, so rows span versions; every segment
of every trained row, sampled again with the native engine at the weights of the version it
recorded (greedy: vLLM's and the native engine's tokens and exits agree), gives the same tokens and
exits and log-probs within 1e-4, and only the sampled tokens carry log-probs. (The prefix cache
across versions is tested in process, with KV blocks small enough to fill: tests/vllm/test_partial.py.)"""

from __future__ import annotations

import pytest
import torch

from rltt.data.rewards import RewardRunner, WeightedReward
from rltt.orchestration.policy import load_policy
from rltt.orchestration.prompt_stream import PromptStream
from rltt.orchestration.ray.builders import EngineFromDir
from rltt.orchestration.orchestration_section import RaySection
from rltt.rollout.seeds import segment_seed
from rltt.orchestration.ray.partial_step import PartialStep
from rltt.rollout import NativeEngine
from tests.vllm.helpers import needs_vllm

from ..helpers import tiny_checkpoint
from .test_partial_rollouts import recipe
from .test_partial_workers import VersionedLearner, version_weights

pytestmark = [pytest.mark.heavy, pytest.mark.slow, needs_vllm]

K, STEPS, MAX_NEW, SEGMENT = 2, 3, 7, 3


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    from rltt.orchestration.ray.rollout_pool import RayRolloutPool

    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("partial-vllm") / "policy", hidden_size=128,
                           intermediate_size=192, head_dim=64, max_position_embeddings=512)  # vLLM's CPU kernels
    r = recipe(K, STEPS, max_new=MAX_NEW)
    r.model.path = str(ckpt)
    r.rollout.temperature, r.rollout.exit_policy, r.rollout.schedule = 0.0, "threshold:0.5", "dense"
    r.rollout.engine = "vllm"
    r.rollout.vllm.kv_cache_gb, r.rollout.vllm.max_model_len, r.rollout.vllm.max_num_seqs = 1, 512, 16
    model, tok = load_policy(ckpt)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pool = RayRolloutPool(EngineFromDir(r, str(ckpt)), RaySection(rollout_workers=1, timeout_s=300))
    try:
        stream = PromptStream(r.data.source, lambda s: tok(s, add_special_tokens=False).input_ids, lambda q: q,
                              seed=r.data.seed)
        runner = RewardRunner([WeightedReward("length", lambda completion, answer, **kw: len(completion) / 20)])
        step = PartialStep(r, pool, VersionedLearner(base), stream, runner, tok.decode, [tok.eos_token_id],
                           max_staleness=K, segment_tokens=SEGMENT, last_step=STEPS)
        trained = []
        for n in range(1, STEPS + 1):
            step(n)
            trained += step.trained
    finally:
        pool.close()
    return step, trained, ckpt, base


def test_vllm_segments_on_a_ray_worker_are_sampled_by_their_versions_weights(run):
    step, trained, ckpt, base = run
    assert step._kind == "vllm" and len(trained) == STEPS * 2
    native = NativeEngine(load_policy(ckpt)[0])
    later = spanned = 0
    for g in trained:
        for j, row in enumerate(g.rows):
            spanned += row.versions_spanned() > 1
            assert all(row.tensor(name).shape == (len(row),) for name in ("logprobs", "exit_logprobs", "versions"))
            for s, a in enumerate(range(0, len(row), SEGMENT)):
                version = int(row.tensor("versions")[a])
                assert len(set(row.tensor("versions")[a:a + SEGMENT].tolist())) == 1
                native.load_weights(version, version_weights(base, version))
                if s == 0:
                    out = native.generate([list(g.task.prompt_ids)],
                                          step.sampling_base([g.seed], step.group_size, min(SEGMENT, MAX_NEW)))
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
