"""SIGTERM / SIGINT in `rltt train` keep the work, and one run folder has one writer.

Real signals to real processes: in-process runs signal themselves at exact points (mid-step,
past the grace, inside a checkpoint write); `rltt train` subprocesses get SIGINT, SIGTERM twice,
a second run on their folder, and kill -9 (a stale lock file). Every stopped or killed run is
resumed and must log what the uninterrupted run logged (every metric but timings), and end with
its weights.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import rltt
from safetensors.torch import load_file

from rltt.orchestration import saver as saver_module
from rltt.orchestration.step import TrainingStep
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.orchestration.trainer import Trainer
from rltt.runtime.checkpoint import checkpoint_dir, list_checkpoints
from rltt.runtime.run_lock import LOCK_FILE
from rltt.runtime.stop import EXIT_STOPPED, Stopped
from rltt.telemetry import read_metrics

from ..subprocess_env import worker_env
from .helpers import tiny_checkpoint

STEPS = 6
REWARDS = """
import os
import time

def varied(completion, answer, **kw):
    return float(len(completion) % 2)  # groups are rarely uniform: every update changes the weights


def gate(completion, answer, **kw):
    # holds the run's rewards (before its update) while the file hold exists and the run has
    # logged as many metrics rows as it says: a step of a subprocess run in progress, for a test
    while _held():
        time.sleep(0.01)
    return 0.0


def _held():
    # the test removes the file while a reward may be reading it: gone means released, never an error
    try:
        with open("hold") as f:
            return _rows() >= int(f.read())
    except (OSError, ValueError):
        return False


def _rows():
    try:
        with open(os.path.join("recipe", "metrics.jsonl")) as f:
            return len(f.readlines())
    except OSError:
        return 0
"""


def _recipe(root: Path, name: str = "recipe.yaml", **train) -> Path:
    policy = root / "policy"
    if not policy.exists():
        tiny_checkpoint(policy)
        (root / "my_rewards.py").write_text(REWARDS)
    recipe = {
        "model": {"path": str(policy)},
        "data": {"source": "synthetic:easy", "eval_size": 4},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}, {"fn": "my_rewards.py:varied"}],
        "rollout": {"prompts_per_step": 2, "group_size": 3, "max_new_tokens": 6},
        "learner": {"lr": 1e-3, "micro_batch_size": 3},
        "train": {"steps": STEPS, "eval_every": 3, "threads": 1, **train},
        "logging": {"run_dir": str(root / name.removesuffix(".yaml")), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 4, "keep_last": 0},
    }
    path = root / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def _checkpoints(run: Path) -> list[int]:
    return [step for step, _ in list_checkpoints(run, saver_module.STATE_FILE)]


def _timing(key: str) -> bool:
    return key.startswith(("time/", "throughput/", "memory/")) or key == "wall_time"


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not _timing(k)} for row in rows]


def _final_weights(run: Path) -> dict:
    return load_file(str(checkpoint_dir(run, STEPS) / "model.safetensors"))


def assert_as_uninterrupted(run: Path, reference: Path) -> None:
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [r["step"] for r in read_metrics(reference)]
    assert _stable(rows) == _stable(read_metrics(reference))
    got, want = _final_weights(run), _final_weights(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run."""
    root = tmp_path_factory.mktemp("reference")
    Trainer(load_train_recipe(_recipe(root)), recipe_root=root).run()
    return root / "recipe"


def _signal_in_rollout(monkeypatch, at_step: int, signum=signal.SIGTERM, then_sleep: float = 0.0):
    """Send ``signum`` to this process when step ``at_step``'s rollout begins (before its update);
    then keep the rollout busy ``then_sleep`` seconds (a long generation)."""
    original = TrainingStep.rollout

    def rollout(self, step):
        if step == at_step:
            os.kill(os.getpid(), signum)
            end = time.monotonic() + then_sleep
            while time.monotonic() < end:
                time.sleep(0.01)
        return original(self, step)

    monkeypatch.setattr(TrainingStep, "rollout", rollout)


def _resume(path: Path) -> None:
    Trainer(load_train_recipe(path), resume=True, recipe_root=path.parent).run()


def test_term_mid_step_finishes_the_step_checkpoints_it_and_resumes_exactly(reference, tmp_path, monkeypatch):
    path = _recipe(tmp_path)
    run = tmp_path / "recipe"
    _signal_in_rollout(monkeypatch, 2)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(Stopped) as info:
        Trainer(load_train_recipe(path), recipe_root=tmp_path).run()
    assert info.value.step == 2 and info.value.checkpoint == checkpoint_dir(run, 2)
    assert "SIGTERM" in str(info.value) and "--resume" in str(info.value)
    assert _checkpoints(run) == [2]  # the step in progress finished and was kept
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # restored
    monkeypatch.undo()
    _resume(path)
    assert_as_uninterrupted(run, reference)


def test_a_step_past_its_grace_is_abandoned_and_the_last_completed_step_kept(reference, tmp_path, monkeypatch):
    path = _recipe(tmp_path, stop_grace_s=0.3)
    run = tmp_path / "recipe"
    _signal_in_rollout(monkeypatch, 3, then_sleep=30)  # a rollout far longer than the grace
    start = time.monotonic()
    with pytest.raises(Stopped) as info:
        Trainer(load_train_recipe(path), recipe_root=tmp_path).run()
    assert time.monotonic() - start < 25  # abandoned after the grace, not after the rollout
    assert info.value.step == 2
    assert _checkpoints(run) == [2]
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]  # step 3 never logged
    monkeypatch.undo()
    _resume(path)
    assert_as_uninterrupted(run, reference)


def test_sigint_during_a_checkpoint_write_lets_it_finish_and_writes_no_second(reference, tmp_path, monkeypatch):
    path = _recipe(tmp_path, stop_grace_s=0)
    run = tmp_path / "recipe"
    original = saver_module.atomic_dir
    signalled = []

    def atomic_dir(final, write):
        def write_then_signal(tmp):
            write(tmp)
            if not signalled:  # inside the first checkpoint's write, before it is moved into place
                signalled.append(tmp)
                os.kill(os.getpid(), signal.SIGINT)
        return original(final, write_then_signal)

    monkeypatch.setattr(saver_module, "atomic_dir", atomic_dir)
    with pytest.raises(Stopped) as info:
        Trainer(load_train_recipe(path), recipe_root=tmp_path).run()
    assert signalled and info.value.step == 4 and "SIGINT" in str(info.value)
    assert _checkpoints(run) == [4]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    _resume(path)
    assert_as_uninterrupted(run, reference)


# --------------------------------------------------------------------------- rltt train processes


def _command(path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rltt.cli.main", "train", str(path), *extra]


def _start(path: Path, *extra: str) -> subprocess.Popen:
    """``rltt train`` in the background; its output goes to files (a full pipe would block it)."""
    log = path.parent / f"train-{time.monotonic_ns()}.log"
    proc = subprocess.Popen(_command(path, *extra), cwd=path.parent, env=worker_env(), stdout=subprocess.DEVNULL,
                            stderr=log.open("w"))
    proc.log = log
    return proc


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for ``proc``; its stderr."""
    proc.wait(timeout=timeout)
    return proc.log.read_text()


def _run(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(path, *extra), cwd=path.parent, env=worker_env(), capture_output=True, text=True,
                          timeout=600)


def _wait_for_rows(proc: subprocess.Popen, run: Path, rows: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            return
        time.sleep(0.01)
    raise AssertionError(f"the run ended ({proc.returncode}) or hung before {rows} metrics rows")


def _gated_recipe(root: Path, **train) -> Path:
    path = _recipe(root, **train)
    recipe = yaml.safe_load(path.read_text())
    recipe["rewards"].append({"fn": "my_rewards.py:gate", "weight": 0.0, "timeout_s": 600})
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def gated_reference(tmp_path_factory) -> Path:
    """The uninterrupted run with the gate reward (weight 0, never held)."""
    root = tmp_path_factory.mktemp("gated_reference")
    Trainer(load_train_recipe(_gated_recipe(root)), recipe_root=root).run()
    return root / "recipe"


def _hold(root: Path, rows: int | None) -> None:
    """Hold the run's rewards once it logged ``rows`` rows (None: release)."""
    if rows is None:
        (root / "hold").unlink()
    else:
        (root / "hold").write_text(str(rows))


@pytest.mark.slow
def test_cli_sigint_exits_stopped_then_a_second_run_is_refused_and_resume_matches(gated_reference, tmp_path):
    path = _gated_recipe(tmp_path)
    run = tmp_path / "recipe"
    _hold(tmp_path, 3)
    proc = _start(path)
    _wait_for_rows(proc, run, 3)  # step 0's evaluation and steps 1-2 logged: step 3 held in its rewards
    # a second run on the held folder, fresh or --resume, is refused before it writes anything
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    for extra in ((), ("--resume",)):
        second = _run(path, *extra)
        assert second.returncode == 2, second.stderr[-2000:]
        line = [x for x in second.stderr.splitlines() if x.startswith("rltt train: error:")]
        assert len(line) == 1 and str(run) in line[0] and f"pid {proc.pid}" in line[0], second.stderr[-2000:]
        assert "Traceback" not in second.stderr
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    _hold(tmp_path, None)  # the step goes on and finishes within its grace
    err = _finish(proc, 120)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    stopped = [x for x in err.splitlines() if x.startswith("rltt train: stopped by SIGINT after step 3")]
    assert len(stopped) == 1 and "--resume" in stopped[0] and "Traceback" not in err, err[-3000:]
    assert _checkpoints(run) == [3] and [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]
    resumed = _run(path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_as_uninterrupted(run, gated_reference)


@pytest.mark.slow
def test_cli_a_second_term_exits_at_once_and_kill_9_leaves_no_stale_lock(gated_reference, tmp_path):
    path = _gated_recipe(tmp_path)
    run = tmp_path / "recipe"
    _hold(tmp_path, 2)
    proc = _start(path)
    _wait_for_rows(proc, run, 2)  # step 2 held
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # the second: at once, as the signal's default action
    err = _finish(proc, 60)
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert "second signal (SIGTERM): exiting now" in err and "Traceback" not in err
    assert _checkpoints(run) == []
    # kill -9 while running: the lock file stays, naming a dead pid; the OS released the lock
    _hold(tmp_path, 3)
    proc = _start(path, "--resume")
    _wait_for_rows(proc, run, 3)
    proc.kill()
    proc.wait()
    assert (run / LOCK_FILE).read_text().split()[0] == str(proc.pid)
    _hold(tmp_path, None)
    resumed = _run(path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_as_uninterrupted(run, gated_reference)


# --------------------------------------------------------------------------- torchrun


def _torchrun(path: Path, *extra: str) -> subprocess.Popen:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = path.parent / f"torchrun-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "rltt.cli.main", "train", str(path), *DEEPSPEED, *extra]
    proc = subprocess.Popen(cmd, cwd=path.parent, env=worker_env(), stdout=subprocess.DEVNULL, stderr=log.open("w"))
    proc.log = log
    return proc


DEEPSPEED = ["learner.backend=deepspeed", "learner.zero_stage=2", "train.steps=3"]


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    import psutil

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank) and "rltt.cli.main" in child.cmdline():
                    return child.pid
            except psutil.Error:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} under torchrun")


@pytest.mark.heavy
@pytest.mark.slow
def test_torchrun_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """SIGTERM to rank 1 only, while step 2 runs: both ranks finish step 2, agree at the step
    boundary, write its checkpoint together and exit with the stopped status; --resume under
    torchrun then logs what the uninterrupted 2-rank run logged."""
    pytest.importorskip("deepspeed")
    reference = tmp_path / "reference"
    reference.mkdir()
    proc = _torchrun(_gated_recipe(reference))
    assert _finish(proc, 600) is not None and proc.returncode == 0, proc.log.read_text()[-3000:]

    path = _gated_recipe(tmp_path)
    run = tmp_path / "recipe"
    _hold(tmp_path, 2)
    proc = _torchrun(path)
    _wait_for_rows(proc, run, 2)  # both ranks held in step 2's rewards
    os.kill(_rank_pid(proc, 1), signal.SIGTERM)
    time.sleep(0.5)
    _hold(tmp_path, None)
    err = _finish(proc, 300)
    assert proc.returncode != 0  # torchrun reports its ranks' status 75 as a failure
    assert err.count("rltt train: stopped by SIGTERM after step 2") == 1, err[-4000:]
    assert err.count("rltt train: stopped by another rank's signal after step 2") == 1, err[-4000:]
    assert "ChildFailedError" in err and f'File "{Path(rltt.__file__).parent}' not in err  # no rank's traceback
    assert _checkpoints(run) == [2] and [r["step"] for r in read_metrics(run)] == [0, 1, 2]
    proc = _torchrun(path, "--resume")
    err = _finish(proc, 600)
    assert proc.returncode == 0, err[-4000:]
    got, want = read_metrics(run), read_metrics(reference / "recipe")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3]
    for g, w in zip(got, want):
        stable = {k: v for k, v in w.items() if not _timing(k) and isinstance(v, (int, float))}
        assert {k: g[k] for k in stable} == pytest.approx(stable, rel=1e-5, abs=1e-7), w["step"]
