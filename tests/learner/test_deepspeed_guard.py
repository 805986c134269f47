"""The DeepSpeed backend's non-finite guard: every rank skips a step whose loss (on any rank) or
global gradient norm is not finite, with its weights and optimizer state bitwise unchanged."""

import json
from pathlib import Path

import pytest

from .helpers import run_worker

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.heavy, pytest.mark.slow]

WORKER = Path(__file__).with_name("ds_guard_worker.py")


def _check(out: Path, world: int, stage: int):
    report = json.loads(out.read_text())
    assert report["world"] == world
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["applied"] == {"name": "applied", "reason": None, "version": 1, "unchanged": False}
    bad = steps["nan_loss"]
    assert bad["version"] == 1 and bad["unchanged"]
    assert bad["reason"] == ("loss is nan" if world == 1 else f"loss is not finite on rank {world - 1}")
    if stage < 3:
        grad = steps["inf_grad"]
        assert grad["reason"] is not None and "gradient" in grad["reason"]
        assert grad["version"] == 1 and grad["unchanged"]
    again = steps["applied_again"]
    assert again["reason"] is None and again["version"] == 2 and not again["unchanged"]


@pytest.mark.parametrize("stage", [0, 3])
def test_one_process_skips_bitwise(stage, tmp_path):
    out = tmp_path / "result.json"
    run_worker(WORKER, stage, out)
    _check(out, 1, stage)


def test_two_processes_skip_together(tmp_path):
    out = tmp_path / "result.json"
    run_worker(WORKER, 2, out, processes=2, master_port=29613)
    _check(out, 2, 2)
