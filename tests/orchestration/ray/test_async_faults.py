"""Faults under ``orchestration.max_staleness: 2`` (rows sampled up to two steps ahead), with real
processes and kill -9:

- a rollout worker killed while it samples ahead during an update: its shard is issued again at
  the same weights version once Ray has restarted it, and the learner trains on exactly the
  batches of an undisturbed run;
- the driver (`rltt train`, a local cluster it started) killed mid-run: ``--resume`` from the
  newest checkpoint — which holds the rows sampled ahead, as many bytes as the memory plan counts
  (`rltt.planning.held_rows`) — ends with the uninterrupted run's metrics and weights.
"""

import json
import os
import signal
import time
from dataclasses import fields

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rltt.learner import LearnerBatch
from rltt.orchestration.ray.driver import CLUSTER_FILE
from rltt.orchestration.saver import STATE_FILE
from rltt.orchestration.ray.learner_group import RayLearnerGroup
from rltt.orchestration.ray.overlap import OVERLAP_SAVED, RESHARDS, STALENESS, WORKER_RESTARTS
from rltt.orchestration.ray.rollout_pool import RayRolloutPool
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.orchestration.trainer import Trainer
from rltt.planning.held_rows import HeldRows
from rltt.runtime.checkpoint import checkpoint_dir, load_state_file
from rltt.telemetry import read_metrics

from ...planning.test_held_rows import tensor_bytes
from ..test_preemption import _checkpoints, _finish, _gated_recipe, _hold, _run, _start, _timing, _wait_for_rows

psutil = pytest.importorskip("psutil")
pytestmark = [pytest.mark.heavy, pytest.mark.slow]

RAY = ["orchestration.backend=ray", "orchestration.ray.timeout_s=120", "orchestration.max_staleness=2"]
# one rollout worker and the learner; a checkpoint after every step; the gate reward of
# tests/orchestration/test_preemption.py (weight 0) holds a subprocess run where a test says
RUN = ["train.steps=5", "train.eval_every=0", "checkpoint.every=1", *RAY]
# fault counters: equal to the undisturbed run's everywhere else
FAULT_KEYS = (WORKER_RESTARTS, RESHARDS)
# measured from the clock: seconds hidden behind the update, the learner's and the workers' idle shares
TIMED = (OVERLAP_SAVED, "orchestration/learner_idle_frac", "orchestration/rollout_idle_frac")


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not (_timing(k) or k in TIMED or k in FAULT_KEYS)}


def _plain(batch: LearnerBatch) -> dict:
    return {f.name: (v.clone() if isinstance(v := getattr(batch, f.name), torch.Tensor) else v) for f in fields(batch)}


def _assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want), 1):
        for key, value in w.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(g[key], value), (step, key)
            else:
                assert g[key] == value, (step, key)


def _record_updates(monkeypatch) -> list[dict]:
    """Every batch the learner group is given, as plain tensors."""
    batches = []
    submit = RayLearnerGroup.submit_update

    def record(self, batch):
        batches.append(_plain(batch))
        return submit(self, batch)

    monkeypatch.setattr(RayLearnerGroup, "submit_update", record)
    return batches


def _record_issues(monkeypatch) -> list[tuple[int, int, int]]:
    """(worker, first row, weights version) of every shard issued to a rollout worker."""
    issued = []
    issue = RayRolloutPool._issue

    def record(self, prompts, part):
        issued.append((part.worker, part.start, self.weights_version))
        return issue(self, prompts, part)

    monkeypatch.setattr(RayRolloutPool, "_issue", record)
    return issued


@pytest.fixture(scope="module")
def undisturbed(ray_cluster, tmp_path_factory):
    """The K = 2 run both tests compare with: its run folder, the batches its learner trained on
    and the shards it issued."""
    root = tmp_path_factory.mktemp("undisturbed")
    with pytest.MonkeyPatch.context() as mp:
        batches = _record_updates(mp)
        issued = _record_issues(mp)
        Trainer(load_train_recipe(_gated_recipe(root), RUN), recipe_root=root).run()
    return root / "recipe", batches, issued


def test_a_rollout_worker_killed_while_sampling_ahead_loses_nothing(ray_cluster, undisturbed, tmp_path, monkeypatch):
    """kill -9 of the rollout worker right after step 4's call went out (sampled ahead during step
    2's update at version 1): the shard comes back from the restarted worker, which reloads
    version 1 first; the learner trains on the undisturbed run's batches, bit for bit."""
    reference, want_batches, want_issued = undisturbed
    batches = _record_updates(monkeypatch)
    issued = _record_issues(monkeypatch)
    calls, pids, killed = [], {}, []
    submit = RayRolloutPool.submit

    def submit_then_kill(self, prompts, params):
        if not pids:  # the actor's own report (pid, node, …), asked while it is idle
            pids.update({info["index"]: info["pid"] for info in self.worker_infos()})
        pending = submit(self, prompts, params)
        calls.append(self.weights_version)
        if len(calls) == 4:  # steps 1, 2, 3 sampled; step 4's call in flight
            os.kill(pids[0], signal.SIGKILL)
            killed.append((pids[0], self.weights_version))
        return pending

    monkeypatch.setattr(RayRolloutPool, "submit", submit_then_kill)
    trainer = Trainer(load_train_recipe(_gated_recipe(tmp_path), RUN), recipe_root=tmp_path)
    pool = trainer.engine
    trainer.run()
    run = tmp_path / "recipe"

    assert calls == [0, 0, 0, 1, 2] and killed == [(pids[0], 1)]  # step 4 sampled at version 1, in step 2's update
    assert want_issued == [(0, 0, v) for v in (0, 0, 0, 1, 2)]
    assert issued == want_issued[:4] + [(0, 0, 1)] + want_issued[4:]  # step 4's shard once more, at version 1
    assert pool.reissued == 1 and pool.reloads == 1  # the restarted worker reloaded version 1 first
    _assert_same_batches(batches, want_batches)
    got = read_metrics(run)
    assert [_stable(r) for r in got] == [_stable(r) for r in read_metrics(reference)]
    assert [r[STALENESS] for r in got] == [0, 1, 2, 2, 2]
    assert got[-1][WORKER_RESTARTS] == 1 and got[-1][RESHARDS] == 1
    actors = json.loads((run / CLUSTER_FILE).read_text())["actors"]
    restarted = [a for a in actors if a["restarts"]]
    assert [(a["role"], a["index"]) for a in restarted] == [("rollout", 0)] and restarted[0]["pid"] != pids[0]


# what a local cluster leaves after its driver's kill -9: Ray's agents, re-parented to init, keep
# running (the test ends them itself)
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


def _alive(procs: dict[int, str]) -> dict[int, str]:
    return {p: name for p, name in procs.items()
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}


def _final_weights(run, step: int) -> dict:
    return load_file(str(checkpoint_dir(run, step) / "model.safetensors"))


def test_the_driver_killed_mid_run_resumes_to_the_uninterrupted_run(ray_cluster, undisturbed, tmp_path):
    """`rltt train` with K = 2 killed -9 in step 3, while it samples step 5 (checkpoint 2 holds steps
    3 and 4's rows, sampled at versions 0 and 1): its actors, raylet, GCS and reward workers go with it, and ``--resume``
    logs the uninterrupted run's metrics and ends with its weights, bit for bit."""
    reference = undisturbed[0]

    path = _gated_recipe(tmp_path)
    run = tmp_path / "recipe"
    _hold(tmp_path, 2)  # steps 1 and 2 logged: the next reward call (step 5's rows) waits
    driver = _start(path, *RUN)
    _wait_for_rows(driver, run, 2)
    time.sleep(1.0)  # in step 3's update, held in step 5's rewards
    actors = {a["pid"]: a["role"] for a in json.loads((run / CLUSTER_FILE).read_text())["actors"]}
    started = {p.pid: p.name() for p in psutil.Process(driver.pid).children(recursive=True)}
    assert sorted(actors.values()) == ["learner", "rollout"] and _alive(actors) == actors
    assert {"raylet", "gcs_server"} <= set(started.values()) and driver.poll() is None
    driver.kill()
    _finish(driver, 60)
    assert driver.returncode == -signal.SIGKILL
    _hold(tmp_path, None)  # the reward worker held in the gate returns, finds its driver gone and exits
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and set(_alive({**started, **actors}).values()) - set(RAY_AGENTS):
        time.sleep(0.2)
    left = _alive({**started, **actors})
    for pid in left:  # this test's processes: not left running, whatever the assertion says
        os.kill(pid, signal.SIGKILL)
    assert set(left.values()) <= set(RAY_AGENTS), left
    assert _checkpoints(run) == [1, 2]
    held = load_state_file(checkpoint_dir(run, 2) / STATE_FILE)["ahead"]
    assert [(s["step"], s["version"]) for s in held] == [(3, 0), (4, 1)]
    recipe = load_train_recipe(path, RUN)  # the plan's count of a held step, at its padded width
    count = HeldRows.from_recipe(recipe, recipe.data.max_prompt_tokens + recipe.rollout.max_new_tokens)
    for s in held:
        groups = s["groups"]
        assert count.step_bytes(groups["batch"]["input_ids"].shape[1]) == tensor_bytes(groups)

    resumed = _run(path, *RUN, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    got, want = read_metrics(run), read_metrics(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5]
    assert [r[STALENESS] for r in got] == [0, 1, 2, 2, 2]
    assert [_stable(r) for r in got] == [_stable(r) for r in want]
    a, b = _final_weights(run, 5), _final_weights(reference, 5)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
