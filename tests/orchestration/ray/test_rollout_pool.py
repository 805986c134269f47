"""`RayRolloutPool`: sharded generate equals one engine, a worker killed mid-call or restarted
with stale weights changes no row, resources the cluster lacks are a one-line error in time."""

import json
import os
import signal
import time
from dataclasses import replace

import pytest
import torch

from rltt.errors import RlttError
from rltt.orchestration.policy import load_policy
from rltt.orchestration.ray.cluster import ClusterLog
from rltt.orchestration.orchestration_section import RaySection
from rltt.orchestration.ray.builders import EngineFromDir
from rltt.orchestration.ray.rollout_pool import RayRolloutPool
from rltt.orchestration.ray.shards import merge, split
from rltt.orchestration.train_recipe import TrainRecipe
from rltt.rollout import NativeEngine, SamplingParams

from ...rollout.helpers import assert_same_passes
from ..helpers import tiny_checkpoint

pytestmark = [pytest.mark.heavy, pytest.mark.slow]

ROW_FIELDS = ("prompt_index", "prompt_lengths", "completion_ids", "completion_lengths", "completion_mask",
              "exit_steps", "logprobs", "tempered_logprobs")
TOKEN_FIELDS = ("prompt_index", "prompt_lengths", "completion_ids", "completion_lengths", "completion_mask",
                "exit_steps")


def builder(ckpt) -> EngineFromDir:
    recipe = TrainRecipe()
    recipe.model.path = str(ckpt)
    return EngineFromDir(recipe, str(ckpt))  # the local loop's engine factory, in the worker


@pytest.fixture(scope="module")
def setup(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool")
    ckpt = tiny_checkpoint(tmp / "policy")
    log = ClusterLog(tmp / "cluster.json")
    pool = RayRolloutPool(builder(ckpt), RaySection(rollout_workers=2, timeout_s=60, max_restarts=4), log)
    model, tok = load_policy(ckpt)
    prompts = [tok(q, add_special_tokens=False).input_ids for q in ("12+3=", "7*8=", "5-1=", "9+9=", "40/5=")]
    params = SamplingParams(max_new_tokens=12, n=3, prompt_seeds=[101, 7, 55, 3, 999],
                            stop_token_ids=[tok.eos_token_id])
    yield pool, NativeEngine(model), prompts, params, tmp / "cluster.json"
    pool.close()


def one_thread(fn):
    """Rollout workers run torch single-threaded; a reference computed with other thread counts
    can differ in the last bits of a log-prob."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def shardwise(engine, prompts, params, workers=2):
    parts = [engine.generate(prompts[a:b], replace(params, prompt_seeds=params.prompt_seeds[a:b]))
             for a, b in split(len(prompts), workers)]
    return merge(parts, params, 0.0)


def assert_rows_equal(a, b, fields=ROW_FIELDS):
    for name in fields:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.finish_reasons == b.finish_reasons
    if fields is ROW_FIELDS:
        assert torch.equal(a.gate_probs.isnan(), b.gate_probs.isnan())
        assert torch.equal(a.gate_probs.nan_to_num(), b.gate_probs.nan_to_num())


def worker_pid(cluster_json, index):
    actors = json.loads(cluster_json.read_text())["actors"]
    return next(a for a in actors if a["role"] == "rollout" and a["index"] == index)


def test_split_is_contiguous_and_balanced():
    assert split(5, 2) == [(0, 3), (3, 5)]
    assert split(2, 4) == [(0, 1), (1, 2)]
    assert split(6, 3) == [(0, 2), (2, 4), (4, 6)]


def test_two_workers_give_the_rows_of_one_engine(setup):
    pool, engine, prompts, params, _ = setup
    before = pool.worker_s
    batch = pool.generate(prompts, params)
    assert 0 < pool.worker_s - before < batch.stats.wall_time  # the workers' own generate seconds
    # bitwise the engine's rows for the same shards (the workers' thread count)
    want = one_thread(lambda: shardwise(engine, prompts, params))
    assert_rows_equal(batch, want)
    # the replay record came back through the object store in its flat form: the same passes
    assert len(batch.schedule.passes) > 0
    assert_same_passes(batch.schedule, want.schedule)
    # one call with all prompts samples the same tokens, exits and finishes: a row's draws are
    # keyed by its prompt seed and sample index, not by its batch-mates
    whole = engine.generate(prompts, params)
    assert_rows_equal(batch, whole, TOKEN_FIELDS)
    torch.testing.assert_close(batch.logprobs, whole.logprobs)
    assert batch.num_rows == len(prompts) * params.n and batch.stats.tokens == whole.stats.tokens
    # a call without prompt seeds (rows keyed by their index in the call) is not split
    seeded = replace(params, prompt_seeds=None, seed=4)
    assert_rows_equal(pool.generate(prompts, seeded), one_thread(lambda: engine.generate(prompts, seeded)))


def test_worker_killed_mid_generate_gives_the_same_batch(setup):
    pool, engine, prompts, params, cluster_json = setup
    expected = one_thread(lambda: shardwise(engine, prompts, params))
    before = worker_pid(cluster_json, 1)
    reissued = pool.reissued
    pending = pool.submit(prompts, params)
    os.kill(before["pid"], signal.SIGKILL)
    assert_rows_equal(pending.result(), expected)
    assert pool.reissued == reissued + 1
    after = worker_pid(cluster_json, 1)
    assert after["pid"] != before["pid"] and after["restarts"] == before["restarts"] + 1


def test_restarted_worker_with_stale_weights_reloads_first(setup):
    pool, engine, prompts, params, cluster_json = setup
    g = torch.Generator().manual_seed(3)
    v1 = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
          for k, v in engine.model.state_dict().items()}
    pool.load_weights(1, v1)
    assert pool.weights_version == 1
    assert [w["version"] for w in pool.worker_infos()] == [1, 1]
    victim = worker_pid(cluster_json, 0)
    os.kill(victim["pid"], signal.SIGKILL)  # Ray restarts it with the step-0 weights of the model dir
    reloads = pool.reloads
    batch = pool.generate(prompts, params)
    assert pool.reloads == reloads + 1  # the restarted worker saw version 0 != 1 and reloaded
    assert [w["version"] for w in pool.worker_infos()] == [1, 1]
    engine.load_weights(1, v1)
    assert_rows_equal(batch, one_thread(lambda: shardwise(engine, prompts, params)))
    step0 = one_thread(lambda: NativeEngine(load_policy(engine_path(cluster_json))[0]).generate(prompts, params))
    assert not torch.equal(batch.logprobs, step0.logprobs)  # stale weights would have shown


def engine_path(cluster_json):
    return cluster_json.parent / "policy"


def test_unschedulable_workers_are_a_one_line_error_within_the_timeout(ray_cluster, setup):
    _, _, _, _, cluster_json = setup
    t0 = time.monotonic()
    with pytest.raises(RlttError) as err:
        RayRolloutPool(builder(engine_path(cluster_json)), RaySection(num_gpus=1, timeout_s=2))
    assert time.monotonic() - t0 < 30
    message = str(err.value)
    assert "\n" not in message and "num_gpus=1" in message and "timeout_s=2" in message
