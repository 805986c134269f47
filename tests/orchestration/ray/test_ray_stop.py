"""SIGTERM to a Ray driver (`rltt train … orchestration.backend=ray`, a local cluster it started):
the step in progress finishes, its checkpoint is written, the driver stops its actors and the
cluster and exits with the stopped status; a second run on the folder is refused meanwhile; and
--resume ends with the local loop's metrics."""

import json
import signal
import time

import pytest

from rltt.orchestration.ray.driver import CLUSTER_FILE
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.orchestration.trainer import Trainer
from rltt.runtime.stop import EXIT_STOPPED
from rltt.telemetry import read_metrics

from ..test_preemption import _checkpoints, _finish, _gated_recipe, _hold, _run, _start, _timing, _wait_for_rows

psutil = pytest.importorskip("psutil")
pytestmark = [pytest.mark.heavy, pytest.mark.slow]

RAY = ["orchestration.backend=ray", "orchestration.ray.timeout_s=120", "train.steps=4"]


def _alive(pids) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_sigterm_to_the_ray_driver_keeps_the_step_and_stops_the_cluster(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    Trainer(load_train_recipe(_gated_recipe(local), ["train.steps=4"]), recipe_root=local).run()

    path = _gated_recipe(tmp_path)
    run = tmp_path / "recipe"
    _hold(tmp_path, 2)
    driver = _start(path, *RAY)
    _wait_for_rows(driver, run, 2)  # step 2 held in the driver's rewards
    refused = _run(path, *RAY, "--resume")
    assert refused.returncode == 2 and f"(pid {driver.pid})" in refused.stderr, refused.stderr[-2000:]
    actors = [a["pid"] for a in json.loads((run / CLUSTER_FILE).read_text())["actors"]]
    started = [p.pid for p in psutil.Process(driver.pid).children(recursive=True)]  # the local cluster
    assert actors and _alive(actors) == actors
    driver.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    _hold(tmp_path, None)
    err = _finish(driver, 300)
    assert driver.returncode == EXIT_STOPPED, err[-4000:]
    assert "rltt train: stopped by SIGTERM after step 2" in err and "Traceback" not in err, err[-4000:]
    assert _checkpoints(run) == [2] and [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    deadline = time.monotonic() + 30
    while _alive(actors + started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(actors + started)  # the driver stopped its actors and the cluster it started

    resumed = _run(path, *RAY, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    got, want = read_metrics(run), read_metrics(local / "recipe")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3, 4]
    for g, w in zip(got, want):  # actors run torch single-threaded: the last bits of a sum may differ
        stable = {k: v for k, v in w.items() if not _timing(k) and isinstance(v, (int, float))}
        assert {k: g[k] for k in stable} == pytest.approx(stable, rel=1e-5, abs=1e-7), w["step"]
