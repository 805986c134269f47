""":class:`MetricsLogger`: one record per step to ``RUN_DIR/metrics.jsonl``, mirrored to sinks.

The file itself (writing, reading back, truncation on resume) is
:mod:`rltt.telemetry.metrics_file`; TensorBoard / W&B are sinks of
:mod:`rltt.telemetry.sinks`; the values logged are computed by :mod:`rltt.telemetry.stats`.

Only one process of a distributed run (rank 0) should own a :class:`MetricsLogger`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from rltt.telemetry import schema
from rltt.telemetry.metrics_file import MetricsWriter, flatten, to_json_value
from rltt.telemetry.sinks import MetricSink, TensorBoardSink, WandbSink

#: Environment variable that turns strict mode on for every :class:`MetricsLogger` built
#: without an explicit ``strict``: ``RLTT_STRICT_METRICS=1`` (the test suite sets it).
STRICT_ENV = "RLTT_STRICT_METRICS"


class MetricsLogger:
    """Per-step metrics to ``RUN_DIR/metrics.jsonl`` (+ TensorBoard / W&B when asked).

    ``resume_step``: the step of the checkpoint a resumed run continues from. The existing
    file is kept (append mode) but its records with ``step > resume_step`` are removed,
    since those steps will be logged again (``resume_step=0``, no checkpoint yet: all of
    them, the step-0 record included). Without it, an existing file is appended to
    as is (a partial last line left by a crash is removed first, so it cannot corrupt the
    next record).

    ``strict``: raise ValueError on keys the vocabulary (:mod:`rltt.telemetry.schema`) does
    not document. None (the default) reads the environment: strict when
    ``RLTT_STRICT_METRICS`` is ``1``/``true``/``yes`` (:func:`strict_from_env`). The test
    suite sets it for the whole session, so every training loop a test runs checks its keys.

    ``sinks``: further :class:`~rltt.telemetry.sinks.MetricSink` objects, after the
    TensorBoard / W&B ones; each gets the numeric values of every record, and the logger
    closes it.

    Each :meth:`log` writes and flushes one line, so ``rltt review`` can read a live run.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        tensorboard: bool = False,
        wandb: bool = False,
        *,
        resume_step: int | None = None,
        wandb_project: str = "rltt",
        wandb_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        strict: bool | None = None,
        sinks: Iterable[MetricSink] = (),
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.strict = strict_from_env() if strict is None else bool(strict)
        self._writer = MetricsWriter(self.run_dir, resume_step)
        self.path = self._writer.path
        self._sinks: list[MetricSink] = []
        try:
            if tensorboard:
                self._sinks.append(TensorBoardSink(self.run_dir / "tensorboard", resume_step))
            if wandb:
                self._sinks.append(WandbSink(self.run_dir, wandb_project, wandb_name, config))
        except BaseException:  # a sink that cannot start: release what was opened, then say why
            self.close()
            raise
        self._sinks.extend(sinks)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one record ``{"step": step, "wall_time": ..., **metrics}``; returns it.

        Nested dicts are flattened with ``/``; tensors and numpy scalars are converted.
        A ``step`` key inside ``metrics`` must agree with ``step``.
        """
        if self._writer.closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        flat = flatten(metrics)
        if schema.STEP in flat and flat.pop(schema.STEP) != step:
            raise ValueError(f"metrics['step'] disagrees with step={step}")
        if self.strict:
            unknown = schema.unknown_keys(flat)
            if unknown:
                raise ValueError(f"metric keys not in rltt.telemetry.schema: {unknown} "
                                 f"(register them in rltt.telemetry.schema.METRICS)")
        record: dict[str, Any] = {schema.STEP: int(step), schema.WALL_TIME: round(time.time(), 3)}
        for key, value in flat.items():
            try:
                record[key] = to_json_value(value)
            except TypeError as exc:
                raise TypeError(f"metric {key!r}: {exc}") from None
        self._writer.write(record)
        if self._sinks:
            numeric = _numeric(record)
            for sink in self._sinks:
                sink.log(int(step), numeric)
        return record

    def close(self) -> None:
        """Flush and close the file and the sinks (idempotent)."""
        self._writer.close()
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def strict_from_env() -> bool:
    """Whether ``RLTT_STRICT_METRICS`` asks for strict metric keys (1 / true / yes / on)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _numeric(record: Mapping[str, Any]) -> dict[str, float]:
    """The values a sink receives: the record's numbers (not bool), minus step / wall_time."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in (schema.STEP, schema.WALL_TIME)
        and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
