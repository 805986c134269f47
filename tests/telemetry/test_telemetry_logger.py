import json
import math
import os
import sys

import numpy as np
import pytest
import torch

from rltt.errors import RlttError
from rltt.telemetry.logger import STRICT_ENV, MetricsLogger, strict_from_env
from rltt.telemetry.metrics_file import read_metrics, scan_metrics, truncate_metrics
from rltt.telemetry.stats import Timer


def lines(path):
    return path.read_text().splitlines()


def test_log_writes_one_flushed_json_line_per_call(tmp_path):
    with MetricsLogger(tmp_path / "run") as logger:
        logger.log(1, {"reward/mean": 0.5, "kl/ref": torch.tensor(1e-3), "length/max": np.int64(7)})
        # readable while the logger is still open (flushed per line)
        records = read_metrics(tmp_path / "run")
        assert len(records) == 1
        logger.log(2, {"reward": {"mean": 0.75, "std": 0.1}, "loss/total": float("nan")})
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["kl/ref"] == pytest.approx(1e-3)
    assert records[0]["length/max"] == 7 and isinstance(records[0]["length/max"], int)
    assert records[1]["reward/mean"] == 0.75 and records[1]["reward/std"] == 0.1  # flattened
    assert math.isnan(records[1]["loss/total"])
    assert all("wall_time" in r for r in records)


def test_log_rejects_bad_values_and_conflicting_step(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        with pytest.raises(TypeError, match="kl/ref"):
            logger.log(1, {"kl/ref": torch.ones(3)})
        with pytest.raises(ValueError, match="step"):
            logger.log(1, {"step": 2})
        logger.log(1, {"step": 1, "lr": 1e-5})  # agreeing step is fine
    assert len(read_metrics(tmp_path)) == 1


def test_strict_mode_rejects_undocumented_keys(tmp_path):
    with MetricsLogger(tmp_path, strict=True) as logger:
        logger.log(1, {"exit/p_1": 0.5, "grad_norm/layer/3": 1.0, "reward/format": 1.0})
        with pytest.raises(ValueError, match="kl/reff"):
            logger.log(2, {"kl/reff": 0.1})


def test_strict_mode_comes_from_the_environment(tmp_path, monkeypatch):
    # the test session runs strict (tests/conftest.py), so every loop test checks its keys
    assert os.environ.get(STRICT_ENV) == "1"
    with MetricsLogger(tmp_path / "a") as logger:
        assert logger.strict
        with pytest.raises(ValueError, match="not in rltt.telemetry.schema.*kl/reff"):
            logger.log(1, {"reward/mean": 0.5, "kl/reff": 0.1})
        logger.log(1, {"eval/solve_rate": 0.5, "rollout/refills": 2, "eval/exit/p_2": 0.3})
    monkeypatch.setenv(STRICT_ENV, "0")
    with MetricsLogger(tmp_path / "b") as logger:
        assert not logger.strict
        logger.log(1, {"kl/reff": 0.1})
    with MetricsLogger(tmp_path / "c", strict=True) as logger:  # explicit beats the environment
        with pytest.raises(ValueError):
            logger.log(1, {"kl/reff": 0.1})
    monkeypatch.setenv(STRICT_ENV, "yes")
    assert strict_from_env()
    monkeypatch.delenv(STRICT_ENV)
    assert not strict_from_env()


def test_append_continues_the_file(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"lr": 1.0})
    with MetricsLogger(tmp_path) as logger:
        logger.log(2, {"lr": 2.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_resume_truncates_records_after_the_resumed_step(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 11):
            logger.log(step, {"lr": float(step)})
    # crash while writing step 11
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "lr": 1')
    with MetricsLogger(tmp_path, resume_step=6) as logger:
        logger.log(7, {"lr": 70.0})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert records[-1]["lr"] == 70.0


def test_reopen_without_resume_drops_a_partial_last_line(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"lr": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lr"')
    with MetricsLogger(tmp_path) as logger:
        logger.log(2, {"lr": 2.0})
    assert lines(tmp_path / "metrics.jsonl")[1].startswith('{"step": 2, "wall_time"')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_read_tolerates_truncated_last_line_and_skips_bad_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n{"step": 3, "rew')
    scanned = scan_metrics(path)
    assert [r["step"] for r in scanned.records] == [1, 2]
    assert scanned.truncated_tail
    assert scanned.bad_lines == [2, 4]
    path.write_text('{"step": 1}\n{"step": 2}\n')
    assert not scan_metrics(path).truncated_tail
    with pytest.raises(RlttError, match="nope"):
        read_metrics(tmp_path / "nope")


def test_truncate_metrics_returns_removed_count(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    assert truncate_metrics(path, 2) == 2
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_tensorboard_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    with MetricsLogger(tmp_path, tensorboard=True, strict=False) as logger:
        logger.log(1, {"reward/mean": 0.5, "note": "text is skipped"})
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(RlttError, match="wandb"):
        MetricsLogger(tmp_path, wandb=True)


def test_timer_measures_and_accumulates():
    metrics = {}
    with Timer(metrics, "time/rollout") as t:
        sum(range(10000))
    first = metrics["time/rollout"]
    assert first == t.elapsed > 0
    with Timer(metrics, "time/rollout"):
        pass
    assert metrics["time/rollout"] >= first
    with pytest.raises(ValueError):
        Timer(metrics)
