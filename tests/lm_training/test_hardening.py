"""Faults in the LM stages: non-finite steps, bad checkpoint files, clobbering output paths."""

import json
import os
import shutil

import pytest
import torch

from rltt.errors import RlttError
from rltt.model import load_looped
from rltt.runtime import checkpoint as ckpt
from rltt.runtime import guard
from rltt.lm_training import stage_loop as trainer_module
from rltt.runtime.paths import check_output_file, check_run_dir
from rltt.lm_training.pretraining import build_pretrain_model, pretrain
from rltt.telemetry import read_metrics, schema

from .helpers import tiny_pretrain_recipe
from .test_pretrain import _stable


def _alarms(run):
    path = run / "alarms.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# --------------------------------------------------------------------------- the non-finite guard


def test_check_names_the_cause():
    model = torch.nn.Linear(2, 2)
    assert guard.check(torch.tensor(1.0), model) is None
    assert guard.check([torch.tensor(1.0), torch.tensor(float("nan"))], model) == "loss is nan"
    model(torch.ones(1, 2)).sum().backward()
    assert guard.check(torch.tensor(1.0), model) is None
    model.bias.grad[0] = float("inf")
    assert guard.check(torch.tensor(1.0), model) == "non-finite gradient in 1 tensor(s), first bias"


def _nan_from(monkeypatch, steps):
    """Make the loss of the given (1-based) optimizer steps NaN."""
    real, calls = trainer_module.batch_loss, {"n": 0}

    def batch_loss(*args, **kw):
        calls["n"] += 1
        loss, probs = real(*args, **kw)
        if calls["n"] in steps:
            loss.loss = loss.loss * float("nan")
        return loss, probs

    monkeypatch.setattr(trainer_module, "batch_loss", batch_loss)


def test_a_nan_step_changes_no_weights_and_the_run_goes_on(tmp_path, monkeypatch):
    _nan_from(monkeypatch, {3})
    run = tmp_path / "run"
    weights = {}

    def snapshot(step, metrics):
        weights[step] = {k: v.detach().clone() for k, v in runner.model.state_dict().items()}

    runner = trainer_module.StageRun(tiny_pretrain_recipe(run, ["train.steps=5", "eval.solve_problems=0"]),
                                     build_pretrain_model, stage="pretrain")
    result = runner.run(snapshot)
    assert result.step == 5
    assert all(torch.equal(weights[2][k], weights[3][k]) for k in weights[2])  # step 3 skipped
    assert any(not torch.equal(weights[3][k], weights[4][k]) for k in weights[3])  # step 4 trained
    skipped = {r["step"]: r[schema.GUARD_SKIPPED_STEPS] for r in read_metrics(run)}
    assert skipped == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    assert [(a["step"], a["kind"]) for a in _alarms(run)] == [(3, "non_finite")]
    assert "loss is nan" in _alarms(run)[0]["message"]


def test_lr_1e30_stops_with_one_line_and_finite_checkpoints(tmp_path):
    run = tmp_path / "run"
    recipe = tiny_pretrain_recipe(run, ["optim.lr=1e30", "optim.warmup_steps=0", "train.steps=20",
                                        "checkpoint.every=1", "eval.solve_problems=0", "checkpoint.keep_last=0"])
    with pytest.raises(RlttError) as info:
        pretrain(recipe)
    message = str(info.value)
    assert "\n" not in message and "consecutive non-finite steps" in message
    stopped = int(message.split(":")[0].split()[1])
    skips = [a["step"] for a in _alarms(run)]
    assert skips[-3:] == [stopped - 2, stopped - 1, stopped]  # K = 3 in a row
    steps = [s for s, _ in ckpt.list_checkpoints(run)]
    assert max(steps) == stopped - 1  # the stopping step wrote no checkpoint
    latest = ckpt.latest_checkpoint(run)
    state = load_looped(latest).state_dict()
    assert all(torch.isfinite(v).all() for v in state.values())
    assert not (run / "final").exists()


# --------------------------------------------------------------------------- checkpoint files


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("name", ["trainer_state.pt", "rl_state.pt", "optimizer.pt"])
def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path, name):
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "x": Exploit(marker)}, tmp_path / name)
    with pytest.raises(RlttError, match="refusing to load") as info:
        ckpt.load_state_file(tmp_path / name)
    assert "\n" not in str(info.value)
    assert not marker.exists()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """An 8-step run with checkpoints at 4 and 8 (the uninterrupted reference)."""
    run = tmp_path_factory.mktemp("full") / "run"
    pretrain(tiny_pretrain_recipe(run))
    return run


def _copy(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "final")
    (run / "summary.json").unlink()
    return run


def test_a_crafted_trainer_state_stops_resume(finished, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    marker = tmp_path / "pwned"
    latest = ckpt.latest_checkpoint(run)
    torch.save({"step": 8, "x": Exploit(marker)}, latest / "trainer_state.pt")
    ckpt.write_manifest(latest)  # even with a consistent manifest
    with pytest.raises(RlttError, match="refusing to load"):
        pretrain(tiny_pretrain_recipe(run), resume=True)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["missing weights", "truncated state", "truncated weights"])
def test_an_invalid_latest_checkpoint_falls_back_to_the_previous(finished, tmp_path, capsys, damage):
    run = _copy(finished, tmp_path)
    latest = ckpt.checkpoint_dir(run, 8)
    if damage == "missing weights":
        (latest / "model.safetensors").unlink()
    else:
        path = latest / ("trainer_state.pt" if damage == "truncated state" else "model.safetensors")
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert ckpt.latest_checkpoint(run) == ckpt.checkpoint_dir(run, 4)
    assert f"skipping checkpoint {latest}" in capsys.readouterr().err
    # resuming redoes steps 5-8 from the step-4 checkpoint: the uninterrupted result
    pretrain(tiny_pretrain_recipe(run), resume=True)
    assert _stable(read_metrics(run)) == _stable(read_metrics(finished))
    wa, wb = load_looped(finished / "final").state_dict(), load_looped(run / "final").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_legacy_checkpoint_without_weights_is_invalid(finished, tmp_path):
    run = _copy(finished, tmp_path)
    latest = ckpt.checkpoint_dir(run, 8)
    (latest / ckpt.MANIFEST).unlink()  # written by an older rltt
    assert ckpt.validate_checkpoint(latest) is None
    (latest / "model.safetensors").unlink()
    assert ckpt.validate_checkpoint(latest) == "no model.safetensors"


def test_retention_keep_last_and_keep_every(tmp_path):
    run = tmp_path / "run"
    pretrain(tiny_pretrain_recipe(run, ["train.steps=7", "checkpoint.every=1", "eval.every=7",
                                        "eval.solve_problems=0", "checkpoint.keep_last=2", "checkpoint.keep_every=3"]))
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [3, 6, 7]
    assert all(ckpt.validate_checkpoint(p) is None for _, p in ckpt.list_checkpoints(run))


def test_stale_writes_are_removed_and_an_interrupted_replace_is_restored(tmp_path):
    root = tmp_path / "checkpoints"
    for name in (".tmp-step-0000004-123", ".staged-step-0000004", ".old-final-77"):
        (root / name).mkdir(parents=True)
    (root / ".tmp-step-0000004-123" / "model.safetensors").write_bytes(b"partial")
    (root / "step-0000002").mkdir()
    (root / ".old-step-0000002-9").mkdir()  # step-0000002 exists: a leftover
    removed = ckpt.clean_stale(root)
    assert sorted(p.name for p in root.iterdir()) == ["final", "step-0000002"]  # .old-final-77 moved back
    assert len(removed) == 3


def test_resume_needs_a_run(tmp_path):
    with pytest.raises(RlttError, match="no run in logging.run_dir") as info:
        pretrain(tiny_pretrain_recipe(tmp_path / "nothing-here"), resume=True)
    assert "\n" not in str(info.value)


def test_the_step0_row_is_not_written_twice_after_resume(tmp_path):
    from rltt.telemetry import MetricsLogger

    with MetricsLogger(tmp_path) as log:  # killed after the initial evaluation, before any checkpoint
        log.log(0, {"eval/solve_rate": 0.25})
        log.log(1, {"loss/total": 1.0})
    with MetricsLogger(tmp_path, resume_step=0) as log:  # --resume with no checkpoint: step 0 again
        log.log(0, {"eval/solve_rate": 0.25})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0]


# --------------------------------------------------------------------------- output paths


def test_run_dir_refuses_inputs_and_files(tmp_path):
    recipe = tmp_path / "summary.json"
    recipe.write_text("{}")
    with pytest.raises(RlttError, match="would overwrite the recipe file"):
        check_run_dir(tmp_path, "logging.run_dir", {"the recipe file": recipe})
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    with pytest.raises(RlttError, match="logging.run_dir: .* is a file"):
        check_run_dir(data, "logging.run_dir")
    with pytest.raises(RlttError, match="is data.source"):
        check_run_dir(tmp_path, "logging.run_dir", {"data.source": tmp_path})
    assert check_run_dir(tmp_path / "run", "logging.run_dir", {"the recipe file": recipe, "data.source": "synthetic"})
    with pytest.raises(RlttError, match="is inside the data source"):
        check_output_file(tmp_path / "x.jsonl", "--kept", {"the data source": tmp_path})


def test_output_dir_that_is_a_file_is_one_line(tmp_path):
    target = tmp_path / "out"
    target.write_text("not a dir")
    with pytest.raises(RlttError, match="logging.run_dir: .* is a file") as info:
        pretrain(tiny_pretrain_recipe(target))
    assert "\n" not in str(info.value) and target.read_text() == "not a dir"


# --------------------------------------------------------------------------- kill -9


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_matches_the_uninterrupted_run(tmp_path):
    """SIGKILL while checkpoints are written every step (ideally inside a write), then --resume:
    stale .tmp dirs are cleaned, no metrics row is duplicated, the result is the uninterrupted one."""
    import signal
    import subprocess
    import sys
    import time

    import yaml

    from rltt.lm_training.stage_recipe import load_stage_recipe

    from .helpers import tiny_pretrain_data

    steps = 10
    extra = {"train": {"steps": steps, "batch_size": 4, "threads": 1}, "logging": {"every": 1, "progress": False},
             "checkpoint": {"every": 1}, "eval": {"every": 5, "loss_batches": 1, "solve_problems": 0}}
    reference = tmp_path / "reference"
    pretrain(load_stage_recipe("pretrain", data=tiny_pretrain_data(reference, **extra)))

    run = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_pretrain_data(run, **extra)))
    command = [sys.executable, "-m", "rltt.cli.main", "pretrain", str(recipe)]
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            root = run / "checkpoints"
            done = [s for s, _ in ckpt.list_checkpoints(run)]
            writing = root.is_dir() and any(p.name.startswith(".tmp-") for p in root.iterdir())
            if done and max(done) >= 3 and (writing or max(done) >= 6):
                break
            time.sleep(0.002)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    resumed = subprocess.run(command + ["--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert _stable(rows) == _stable(read_metrics(reference))
    wa, wb = load_looped(reference / "final").state_dict(), load_looped(run / "final").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
