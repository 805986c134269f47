import sys

import pytest
import torch

from rltt.errors import RlttError
from rltt.telemetry import MetricsLogger, read_metrics
from rltt.telemetry.sinks import MetricSink, TensorBoardSink, WandbSink


class FakeSink:
    def __init__(self):
        self.rows = []
        self.closed = 0

    def log(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def close(self):
        self.closed += 1


def numeric_part(record):
    return {k: float(v) for k, v in record.items() if k not in ("step", "wall_time")
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


def test_a_sink_gets_every_row_written_and_is_closed_once(tmp_path):
    sink = FakeSink()
    assert isinstance(sink, MetricSink)
    with MetricsLogger(tmp_path, strict=False, sinks=[sink]) as logger:
        logger.log(1, {"reward/mean": 0.5, "kl/ref": torch.tensor(1e-3), "length/max": 7,
                       "note": "text", "flag": True, "missing": None})
        logger.log(2, {"reward": {"mean": 0.75}, "loss/total": float("nan")})
        logger.close()  # idempotent: the sink is closed once
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert len(sink.rows) == len(records)
    for (step, got), record in zip(sink.rows, records):
        assert step == record["step"] and isinstance(step, int)
        want = numeric_part(record)
        assert got.keys() == want.keys()
        assert all(g == w or (g != g and w != w) for g, w in zip(got.values(), want.values()))
    assert sink.rows[0][1] == {"reward/mean": 0.5, "kl/ref": pytest.approx(1e-3), "length/max": 7.0}
    assert sink.closed == 1


def test_tensorboard_sink_writes_the_logged_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, tensorboard=True, strict=False) as logger:
        logger.log(1, {"reward/mean": 0.5, "length/max": 7, "note": "text is skipped"})
        logger.log(2, {"reward/mean": 0.25})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["length/max", "reward/mean"]
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("length/max")] == [(1, 7.0)]


def test_tensorboard_sink_alone(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path)
    sink.log(3, {"lr": 1e-5})
    sink.close()
    sink.close()  # idempotent
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("lr")] == [(3, pytest.approx(1e-5))]


def test_missing_tensorboard_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import -> ImportError
    with pytest.raises(RlttError, match=r"'tensorboard' package is not installed"):
        TensorBoardSink(tmp_path)
    with pytest.raises(RlttError, match=r"pip install 'rltt\[logging\]'"):
        MetricsLogger(tmp_path, tensorboard=True)


def test_missing_wandb_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(RlttError, match=r"'wandb' package is not installed"):
        WandbSink(tmp_path)
    with pytest.raises(RlttError, match=r"pip install wandb, or turn wandb logging off"):
        MetricsLogger(tmp_path, wandb=True)


def test_wandb_sink_logs_to_an_offline_run(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", dict(metrics), step))

        def finish(self):
            calls.append(("finish",))

    class FakeWandb:
        @staticmethod
        def init(**kwargs):
            calls.append(("init", kwargs))
            return Run()

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    with MetricsLogger(tmp_path, wandb=True, wandb_name="n", config={"lr": 1e-5},
                       strict=False) as logger:
        logger.log(4, {"reward/mean": 0.5, "note": "text is skipped"})
    assert calls == [
        ("init", {"project": "rltt", "name": "n", "dir": str(tmp_path), "mode": "offline",
                  "config": {"lr": 1e-5}, "resume": "allow"}),
        ("log", {"reward/mean": 0.5}, 4),
        ("finish",),
    ]
