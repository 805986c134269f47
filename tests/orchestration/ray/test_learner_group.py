"""`RayLearnerGroup`: 2 DeepSpeed learner actors (a gloo group formed from Ray) give one
process's update; a group the cluster cannot place is a one-line error within the timeout."""

import os
import signal
import time

import pytest

from rltt.errors import RlttError
from rltt.orchestration.ray.builders import LearnerFromDir
from rltt.orchestration.orchestration_section import RaySection
from rltt.orchestration.ray.learner_group import RayLearnerGroup
from rltt.orchestration.train_recipe import load_train_recipe

from ...learner.helpers import synthetic_batch
from ..test_local import write_recipe

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.heavy, pytest.mark.slow]

KEYS = ("loss/total", "loss/policy", "kl/ref", "policy/clip_frac", "policy/ratio_mean", "policy/ratio_max",
        "entropy/loop_1", "entropy/loop_3", "exit/p_1", "exit/mean_step", "grad_norm/total")


def test_two_learners_match_one_process(ray_cluster, tmp_path):
    path = write_recipe(tmp_path)  # prompts_per_step 2 x group_size 3: 3 sequences per learner
    common = ["learner.micro_batch_size=1", "learner.lr=1e-2", "learner.grad_clip=0.5", "learner.warmup_steps=2"]
    ds = load_train_recipe(path, common + ["learner.backend=deepspeed", "learner.zero_stage=2"])
    ref = load_train_recipe(path, common)
    model_path = str(tmp_path / "policy")
    vocab = len(__import__("json").loads((tmp_path / "policy" / "tokenizer.json").read_text())["model"]["vocab"])
    batches = [synthetic_batch(B=6, seed=s, vocab=vocab, group_size=3) for s in range(3)]

    group = RayLearnerGroup(LearnerFromDir(ds, model_path), RaySection(learners=2, timeout_s=240))
    try:
        assert len({w["pid"] for w in group.worker_infos()}) == 2
        got = [group.update(b) for b in batches]
        version, tensors = group.rollout_state_dict()
        state = {k: v.float().clone() for k, v in tensors.items()}
        assert version == group.version == 3
        ckpt = tmp_path / "ckpt"
        group.save(ckpt)  # collective: rank 0 the weights, each rank its ZeRO shard
        group.checkpointed(ckpt)
        assert len(list((ckpt / "deepspeed").rglob("zero_pp_rank_*"))) == 2
        os.kill(group.worker_infos()[1]["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RlttError) as err:  # rank 0 waits in a collective: the dead rank ends the step
            group.update(batches[0])
        assert time.monotonic() - t0 < 60
        assert "\n" not in str(err.value) and f"resume from {ckpt} with --resume" in str(err.value)
    finally:
        group.close()

    local = LearnerFromDir(ref, model_path)()
    want = [local.update(b) for b in batches]
    assert local.version == 3
    # the 2-process DeepSpeed tests' tolerances (rltt.learner tests)
    assert got[0]["loss/total"] == pytest.approx(want[0]["loss/total"], rel=1e-5, abs=1e-7)
    for g, w in zip(got, want):
        for key in KEYS:
            assert g[key] == pytest.approx(w[key], rel=1e-3, abs=1e-5), key
    _, ref_state = local.rollout_state_dict()
    assert max((state[k] - v.float()).abs().max().item() for k, v in ref_state.items()) < 1e-4


def test_unplaceable_learner_group_is_a_one_line_error(ray_cluster, tmp_path):
    path = write_recipe(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(RlttError) as err:
        RayLearnerGroup(LearnerFromDir(load_train_recipe(path), str(tmp_path / "policy")),
                        RaySection(learners=2, num_cpus=64, timeout_s=2))
    assert time.monotonic() - t0 < 30
    assert "\n" not in str(err.value) and "placement group" in str(err.value)
    assert "CPU" in str(err.value)
