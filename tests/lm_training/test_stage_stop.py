"""SIGTERM / SIGINT in `rltt pretrain` (and `rltt convert`: the same loop) keep the work, and a
held run folder is refused. Real signals, sent by the run to itself at exact points; each
stopped run is resumed and must equal the uninterrupted run (metrics but timings; final weights)."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from rltt.errors import RlttError
from rltt.lm_training import stage_loop
from rltt.lm_training.pretraining import pretrain
from rltt.model import load_looped
from rltt.runtime import checkpoint as ckpt
from rltt.runtime.run_lock import LOCK_FILE
from rltt.runtime.stop import Stopped
from rltt.telemetry import read_metrics

from ..subprocess_env import worker_env
from .helpers import tiny_pretrain_recipe
from .test_pretrain import _stable

EXTRA = ["eval.solve_problems=0", "train.grad_accum=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("reference") / "run"
    pretrain(tiny_pretrain_recipe(run, EXTRA))
    return run


def _signal_at_batch(monkeypatch, batch: int, signum=signal.SIGTERM):
    """Send ``signum`` to this process before the ``batch``-th loss (1-based; 2 per step)."""
    real, calls = stage_loop.batch_loss, {"n": 0}

    def batch_loss(*args, **kw):
        calls["n"] += 1
        if calls["n"] == batch:
            os.kill(os.getpid(), signum)
        return real(*args, **kw)

    monkeypatch.setattr(stage_loop, "batch_loss", batch_loss)


def _assert_as_uninterrupted(run, reference):
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))
    assert _stable(read_metrics(run)) == _stable(read_metrics(reference))
    wa, wb = load_looped(reference / "final").state_dict(), load_looped(run / "final").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("grace, signum, kept", [(20, signal.SIGTERM, 3), (0, signal.SIGINT, 2)])
def test_a_signal_mid_step_keeps_the_last_completed_step_and_resume_matches(reference, tmp_path, monkeypatch,
                                                                             grace, signum, kept):
    """Mid step 3 (between its two batches): with a grace the step finishes and is kept; with
    none it is abandoned and step 2 is kept."""
    run = tmp_path / "run"
    _signal_at_batch(monkeypatch, 6, signum)
    with pytest.raises(Stopped) as info:
        pretrain(tiny_pretrain_recipe(run, EXTRA + [f"train.stop_grace_s={grace}"]))
    assert info.value.step == kept and info.value.checkpoint == ckpt.checkpoint_dir(run, kept)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [kept]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, kept + 1))
    assert not (run / "final").exists()
    monkeypatch.undo()
    pretrain(tiny_pretrain_recipe(run, EXTRA), resume=True)
    _assert_as_uninterrupted(run, reference)


def test_a_signal_on_a_checkpointed_step_writes_no_second(reference, tmp_path, monkeypatch):
    run = tmp_path / "run"

    def stop_after_4(step, metrics):  # after step 4's checkpoint
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Stopped) as info:
        pretrain(tiny_pretrain_recipe(run, EXTRA), on_step=stop_after_4)
    assert info.value.step == 4 and [s for s, _ in ckpt.list_checkpoints(run)] == [4]
    pretrain(tiny_pretrain_recipe(run, EXTRA), resume=True)
    _assert_as_uninterrupted(run, reference)


HOLD = """
import sys, time
from rltt.runtime.run_lock import RunLock
RunLock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def test_a_held_run_folder_is_refused_before_anything_is_written(reference, tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], env=worker_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for resume in (False, True):
            with pytest.raises(RlttError, match=f"logging.run_dir: {run} is in use by another run "
                                                f"\\(pid {holder.pid}\\)"):
                pretrain(tiny_pretrain_recipe(run, EXTRA), resume=resume)
        assert [p.name for p in run.iterdir()] == [LOCK_FILE]
    finally:
        holder.kill()
        holder.wait()
