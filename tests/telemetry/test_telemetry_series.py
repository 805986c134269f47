import math

import pytest

from rltt.errors import RlttError
from rltt.telemetry import schema
from rltt.telemetry.series import RunData
from tests.telemetry.telemetry_synth import write_run


def test_records_merge_by_step_and_sort():
    run = RunData.from_records([
        {"step": 2, "reward/mean": 0.5},
        {"step": 1, "reward/mean": 0.1, "note": "text"},
        {"step": 2, "kl/ref": 0.01},  # learner metrics logged in a second call
        {"step": 2, "reward/mean": 0.6},  # a later value wins
        {"reward/mean": 9.0},  # no step: ignored
        {"step": 3, "loss/total": float("nan"), "flag": True},
    ])
    assert list(run.steps) == [1, 2, 3]
    steps, values = run.series("reward/mean")
    assert list(steps) == [1, 2] and list(values) == [0.1, 0.6]
    assert run.keys == ["kl/ref", "loss/total", "reward/mean"]  # numbers only
    assert run.series("loss/total")[1].size == 0
    assert math.isnan(run.series("loss/total", finite=False)[1][0])
    assert run.last("reward/mean") == 0.6 and run.last("missing") is None
    assert run.step_range == (1, 3)


def test_indexed_keys_of_a_run():
    run = RunData.from_records([{"step": 1, "exit/p_2": 0.5, "exit/p_1": 0.5,
                                 "grad_norm/layer/10": 1.0, "grad_norm/layer/2": 1.0}])
    assert run.indexed(schema.EXIT_P) == {1: "exit/p_1", 2: "exit/p_2"}
    assert list(run.indexed(schema.GRAD_NORM_LAYER)) == [2, 10]


def test_load_from_dir_or_file(tmp_path):
    write_run(tmp_path / "r", [{"step": 1, "lr": 1.0}])
    assert RunData.load(tmp_path / "r").name == "r"
    by_file = RunData.load(tmp_path / "r" / "metrics.jsonl")
    assert by_file.path == tmp_path / "r" and len(by_file) == 1
    with pytest.raises(RlttError, match="run directory not found"):
        RunData.load(tmp_path / "x")
