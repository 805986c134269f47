"""`rltt train RECIPE orchestration.backend=ray`: the same training step as the local loop, so the
same metrics.jsonl (every numeric key but timings) — also when a rollout worker is killed
mid-generate, and with 2 DeepSpeed learners (against the one-process DeepSpeed loop);
`overlap: 1` trains one step off-policy and resumes exactly, and so does `max_staleness: 2` two steps."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rltt.cli.main import main
from rltt.orchestration.trainer import Trainer
from rltt.orchestration.ray.rollout_pool import RayRolloutPool
from rltt.orchestration.ray.overlap import (LEARNER_IDLE, OVERLAP_SAVED, RESHARDS, ROLLOUT_IDLE, STALENESS,
                                            STALENESS_MEAN, WORKER_RESTARTS)
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.telemetry import read_metrics
from rltt.telemetry.schema import ROLLOUT_OCCUPANCY, ROLLOUT_OCCUPANCY_WAITING

from ..test_local import write_recipe

pytestmark = [pytest.mark.heavy, pytest.mark.slow]

STEPS = ["train.steps=6", "train.eval_every=3", "checkpoint.every=3"]
RAY = ["orchestration.backend=ray", "orchestration.ray.timeout_s=120"]


def timing(key: str) -> bool:
    """Keys that are not functions of the rows: timings, and how full each engine's passes were — rows
    split over two workers fill each worker's row bound half as much as one batch fills it (rows and
    every other metric stay the local loop's)."""
    return key.startswith(("time/", "throughput/")) or key in ("wall_time", "memory/peak_gb") \
        or key in (OVERLAP_SAVED, LEARNER_IDLE, ROLLOUT_IDLE, ROLLOUT_OCCUPANCY, ROLLOUT_OCCUPANCY_WAITING)


def assert_same_metrics(got: list[dict], want: list[dict], exact: bool = False, rel: float = 1e-5,
                        abs: float = 1e-7):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for key, value in w.items():
            if timing(key) or not isinstance(value, (int, float)):
                continue
            assert key in g, (w["step"], key)
            if exact:
                assert g[key] == value, (w["step"], key)
            else:  # actors run torch single-threaded: the last bits of a sum may differ
                assert g[key] == pytest.approx(value, rel=rel, abs=abs), (w["step"], key)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    Trainer(load_train_recipe(write_recipe(tmp), STEPS), recipe_root=tmp).run()
    return read_metrics(tmp / "run")


def _kill_actor(run_dir, role: str, index: int = 0) -> int:
    """kill -9 the actor ``(role, index)`` named in the run's cluster.json; returns its pid."""
    actors = json.loads((run_dir / "cluster.json").read_text())["actors"]
    pid = next(a["pid"] for a in actors if a["role"] == role and a["index"] == index)
    os.kill(pid, signal.SIGKILL)
    return pid


def test_ray_run_with_a_worker_killed_mid_generate_equals_the_local_loop(ray_cluster, local_run, tmp_path,
                                                                         monkeypatch):
    path = write_recipe(tmp_path)
    run_dir = tmp_path / "run"
    calls, killed = [], []
    submit = RayRolloutPool.submit

    def submit_then_kill(self, prompts, params):
        pending = submit(self, prompts, params)
        calls.append(len(pending.parts))
        if len(calls) == 4:  # step 3's rollout (after the step-0 evaluation and steps 1-2), in flight
            killed.append(_kill_actor(run_dir, "rollout", pending.parts[-1].worker))
        return pending

    monkeypatch.setattr(RayRolloutPool, "submit", submit_then_kill)
    assert main(["train", str(path), *STEPS, *RAY, "orchestration.ray.rollout_workers=2"]) == 0
    assert len(killed) == 1 and calls[1:4] == [2, 2, 2]  # each step's prompts split over both workers
    records = read_metrics(run_dir)
    assert_same_metrics(records, local_run)
    steps = [r for r in records if r["step"] > 0]
    assert [r[STALENESS] for r in steps] == [0] * 6
    assert steps[-1][WORKER_RESTARTS] == 1 and steps[-1][RESHARDS] == 1
    actors = json.loads((run_dir / "cluster.json").read_text())["actors"]
    assert sorted((a["role"], a["index"]) for a in actors) == [("learner", 0), ("rollout", 0), ("rollout", 1)]
    restarted = [a for a in actors if a["restarts"]]
    assert len(restarted) == 1 and restarted[0]["pid"] != killed[0]


def test_ray_run_with_the_learner_killed_mid_update_restarts_and_equals_the_local_loop(
        ray_cluster, local_run, tmp_path, monkeypatch, capsys):
    """kill -9 of the learner actor during step 5's update: the group is rebuilt from the step-3
    checkpoint, steps 4-6 are redone, and metrics.jsonl equals the uninterrupted local loop's."""
    from rltt.orchestration.ray.learner_group import RayLearnerGroup

    path = write_recipe(tmp_path)
    run_dir = tmp_path / "run"
    updates, killed = [], []
    submit = RayLearnerGroup.submit_update

    def submit_then_kill(self, batch):
        pending = submit(self, batch)
        updates.append(self.version)
        if len(updates) == 5 and not killed:  # step 5's update, in flight
            killed.append(_kill_actor(run_dir, "learner"))
        return pending

    monkeypatch.setattr(RayLearnerGroup, "submit_update", submit_then_kill)
    assert main(["train", str(path), *STEPS, *RAY]) == 0
    assert len(killed) == 1
    assert updates == [0, 1, 2, 3, 4, 3, 4, 5]  # steps 4-6 redone from the step-3 checkpoint's version
    assert "rebuilding the learner group from" in capsys.readouterr().err
    assert_same_metrics(read_metrics(run_dir), local_run)
    cluster = json.loads((run_dir / "cluster.json").read_text())
    assert cluster["learner_group_restarts"] == 1
    learner = next(a for a in cluster["actors"] if a["role"] == "learner")
    assert learner["pid"] != killed[0]


def test_learner_restarts_zero_stops_with_the_checkpoint_to_resume_from(ray_cluster, tmp_path, monkeypatch, capsys):
    from rltt.orchestration.ray.learner_group import RayLearnerGroup
    from rltt.runtime.checkpoint import checkpoint_dir

    path = write_recipe(tmp_path)
    run_dir = tmp_path / "run"
    submit = RayLearnerGroup.submit_update
    calls = []

    def submit_then_kill(self, batch):
        pending = submit(self, batch)
        calls.append(1)
        if len(calls) == 4:
            _kill_actor(run_dir, "learner")
        return pending

    monkeypatch.setattr(RayLearnerGroup, "submit_update", submit_then_kill)
    assert main(["train", str(path), *STEPS, *RAY, "orchestration.ray.learner_restarts=0"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rltt train: error:")]
    assert len(err) == 1 and "a learner died" in err[0], err  # step 4's update: one line
    assert f"resume from {checkpoint_dir(run_dir, 3)} with --resume" in err[0]


DEEPSPEED = ["learner.backend=deepspeed", "learner.zero_stage=2"]


def test_ray_run_with_two_learners_equals_the_local_deepspeed_loop(ray_cluster, tmp_path):
    pytest.importorskip("deepspeed")
    local = write_recipe(tmp_path / "local")
    env = dict(os.environ, OMP_NUM_THREADS="1",  # the learner actors run torch single-threaded too
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[3]), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "rltt" / "torch_extensions"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # left by in-process DeepSpeed
        env.pop(key, None)  # tests, whose live group still holds that port: the run picks its own
    # its own process: DeepSpeed forms a one-rank process group there
    proc = subprocess.run([sys.executable, "-m", "rltt.cli.main", "train", str(local), *STEPS, *DEEPSPEED],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = read_metrics(tmp_path / "local" / "run")

    path = write_recipe(tmp_path / "ray")  # prompts_per_step 2 x group_size 3: 3 sequences per learner
    assert main(["train", str(path), *STEPS, *DEEPSPEED, *RAY, "orchestration.ray.learners=2"]) == 0
    got = read_metrics(tmp_path / "ray" / "run")
    # the 2-process DeepSpeed tests' tolerances (tests/learner/test_deepspeed.py): the first
    # update's loss equal up to summation order, every other metric within rel 1e-3
    first = next(i for i, r in enumerate(want) if "loss/total" in r)
    assert got[first]["loss/total"] == pytest.approx(want[first]["loss/total"], rel=1e-5, abs=1e-7)
    assert_same_metrics(got, want, rel=1e-3, abs=1e-5)
    assert [r[STALENESS] for r in got if r["step"] > 0] == [0] * 6
    actors = json.loads((tmp_path / "ray" / "run" / "cluster.json").read_text())["actors"]
    assert sorted((a["role"], a["index"]) for a in actors) == [("learner", 0), ("learner", 1), ("rollout", 0)]
    assert len({a["pid"] for a in actors if a["role"] == "learner"}) == 2


OVERLAP = ["train.steps=3", "train.eval_every=0", "checkpoint.every=1", *RAY, "orchestration.overlap=1"]


def test_overlap_trains_one_step_stale_and_resumes_exactly(ray_cluster, tmp_path, monkeypatch):
    straight = write_recipe(tmp_path / "a")
    Trainer(load_train_recipe(straight, OVERLAP), recipe_root=tmp_path / "a").run()
    want = read_metrics(tmp_path / "a" / "run")
    assert [r[STALENESS] for r in want] == [0, 1, 1]  # step 1 sampled at version 0, steps 2-3 one version late
    assert all(OVERLAP_SAVED in r for r in want[:2]) and OVERLAP_SAVED not in want[2]

    crashed = write_recipe(tmp_path / "b")
    save = Trainer.save

    def save_then_crash(self):
        final = save(self)
        if self.step == 1:
            raise KeyboardInterrupt  # the run dies after step 1's checkpoint, its step-2 rollouts in flight
        return final

    monkeypatch.setattr(Trainer, "save", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        Trainer(load_train_recipe(crashed, OVERLAP), recipe_root=tmp_path / "b").run()
    monkeypatch.setattr(Trainer, "save", save)
    Trainer(load_train_recipe(crashed, OVERLAP), resume=True, recipe_root=tmp_path / "b").run()
    assert_same_metrics(read_metrics(tmp_path / "b" / "run"), want, exact=True)


STALE2 = ["train.steps=4", "train.eval_every=0", "checkpoint.every=1", *RAY, "orchestration.max_staleness=2"]


@pytest.fixture(scope="module")
def stale2_run(ray_cluster, tmp_path_factory):
    """The metrics of an uninterrupted ``max_staleness: 2`` run with one rollout worker."""
    root = tmp_path_factory.mktemp("stale2")
    Trainer(load_train_recipe(write_recipe(root), STALE2), recipe_root=root).run()
    return read_metrics(root / "run")


def test_max_staleness_2_trains_min_n_minus_1_2_stale_and_resumes_exactly(stale2_run, tmp_path, monkeypatch):
    """Step n's rows are sampled at version max(0, n - 3): staleness 0, 1, 2, 2; killed after step
    1's checkpoint (steps 2 and 3 held in it), the resumed run logs what the uninterrupted one did."""
    want = stale2_run
    assert [r[STALENESS] for r in want] == [r[STALENESS_MEAN] for r in want] == [0, 1, 2, 2]
    assert [OVERLAP_SAVED in r for r in want] == [True, True, False, False]  # step 1 samples 2-3, step 2 samples 4

    crashed = write_recipe(tmp_path / "b")
    save = Trainer.save

    def save_then_crash(self):
        final = save(self)
        if self.step == 1:
            raise KeyboardInterrupt  # dies after step 1's checkpoint, which holds steps 2 and 3's rows
        return final

    monkeypatch.setattr(Trainer, "save", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        Trainer(load_train_recipe(crashed, STALE2), recipe_root=tmp_path / "b").run()
    monkeypatch.setattr(Trainer, "save", save)
    Trainer(load_train_recipe(crashed, STALE2), resume=True, recipe_root=tmp_path / "b").run()
    assert_same_metrics(read_metrics(tmp_path / "b" / "run"), want, exact=True)


def test_max_staleness_2_on_two_rollout_workers_samples_what_one_worker_does(stale2_run, tmp_path):
    """The deterministic pipeline with each call sharded over two rollout workers: the same staleness
    schedule and every metric of the one-worker run (up to the rounding of smaller batches)."""
    path = write_recipe(tmp_path)
    Trainer(load_train_recipe(path, [*STALE2, "orchestration.ray.rollout_workers=2"]), recipe_root=tmp_path).run()
    got = read_metrics(tmp_path / "run")
    assert [r[STALENESS] for r in got] == [r[STALENESS_MEAN] for r in got] == [0, 1, 2, 2]
    assert [OVERLAP_SAVED in r for r in got] == [True, True, False, False]
    assert_same_metrics(got, stale2_run)
    actors = json.loads((tmp_path / "run" / "cluster.json").read_text())["actors"]
    assert sorted(a["index"] for a in actors if a["role"] == "rollout") == [0, 1]
