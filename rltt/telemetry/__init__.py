"""Run telemetry: the metric vocabulary, the logger and ``rltt review``.

- :mod:`rltt.telemetry.schema` — metric keys every step logs (name → meaning, unit).
- :mod:`rltt.telemetry.logger` — :class:`MetricsLogger`: one record per step to the metrics
  file, mirrored to the sinks.
- :mod:`rltt.telemetry.metrics_file` — ``RUN_DIR/metrics.jsonl``: writing records,
  :func:`read_metrics` / :func:`scan_metrics`, :func:`truncate_metrics` on resume.
- :mod:`rltt.telemetry.sinks` — the :class:`~rltt.telemetry.sinks.MetricSink` protocol and
  its TensorBoard / W&B implementations (optional packages, imported when used).
- :mod:`rltt.telemetry.stats` — the helpers that compute grad norms, exit/entropy/mismatch
  stats, peak memory and timings.
- :mod:`rltt.telemetry.run_review` — :func:`review`, :func:`format_summary`, :func:`maybe_review`
  (diagnoses in :mod:`~rltt.telemetry.diagnoses`, figures in :mod:`~rltt.telemetry.plots`).

The review modules (matplotlib) are imported lazily, so importing the logger stays cheap.
"""

from rltt.telemetry.logger import MetricsLogger
from rltt.telemetry.metrics_file import read_metrics, truncate_metrics
from rltt.telemetry.stats import (
    Timer,
    entropy_stats,
    exit_stats,
    grad_norms,
    mismatch_stats,
    peak_memory_gb,
    reset_peak_memory,
)

__all__ = [
    "MetricsLogger", "Timer", "entropy_stats", "exit_stats", "grad_norms", "mismatch_stats",
    "peak_memory_gb", "reset_peak_memory", "read_metrics", "truncate_metrics", "review", "maybe_review",
    "format_summary", "Report",
]


def __getattr__(name: str):
    if name in ("review", "maybe_review", "format_summary", "Report"):
        from rltt.telemetry import run_review as _review

        return getattr(_review, name)
    raise AttributeError(f"module 'rltt.telemetry' has no attribute {name!r}")
