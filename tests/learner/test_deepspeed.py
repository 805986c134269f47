"""The DeepSpeed backend (CPU, gloo) matches the torch backend: 1 process at ZeRO 0–3, 2 processes."""

import json
from pathlib import Path

import pytest

from tests.learner.helpers import run_worker

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.heavy, pytest.mark.slow]

WORKER = Path(__file__).with_name("ds_worker.py")


def _check(result_file: Path, world: int):
    result = json.loads(result_file.read_text())
    assert result["world"] == world
    # the first step's loss is computed before any update: equal up to summation order
    assert result["ds_losses"][0] == pytest.approx(result["torch_losses"][0], rel=1e-5, abs=1e-7)
    for ds, ref in zip(result["ds_losses"], result["torch_losses"]):
        assert ds == pytest.approx(ref, rel=1e-3, abs=1e-5)
    assert result["max_param_diff"] < 1e-4
    # sync/changed_frac (fp32, lr 1e-2): nearly every element moves on both backends, on every rank count
    for ds, ref in zip(result["ds_changed"], result["torch_changed"]):
        assert ds > 0.9 and ds == pytest.approx(ref, abs=0.02)
    # clip/ratio statistics and loop telemetry describe the global batch on every rank count
    for ds, ref in zip(result["ds_global"], result["torch_global"]):
        for key, value in ref.items():
            assert ds[key] == pytest.approx(value, rel=1e-3, abs=1e-5), key


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_process_matches_torch_backend(stage, tmp_path):
    out = tmp_path / "result.json"
    run_worker(WORKER, stage, out)
    _check(out, 1)


@pytest.mark.parametrize("stage", [2])
def test_two_processes_match_torch_backend(stage, tmp_path):
    out = tmp_path / "result.json"
    run_worker(WORKER, stage, out, processes=2, master_port=29611)
    _check(out, 2)
