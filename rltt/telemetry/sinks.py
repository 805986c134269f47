"""Where a run's numeric metrics are mirrored besides ``metrics.jsonl``: the metric sinks.

A sink is anything with ``log(step, metrics)`` and ``close()`` (:class:`MetricSink`);
:class:`~rltt.telemetry.logger.MetricsLogger` hands every sink the numeric values of each
record it writes. Two ship here, each importing its optional package only when built:

- :class:`TensorBoardSink` — scalars to ``RUN_DIR/tensorboard`` (package ``tensorboard``).
- :class:`WandbSink` — an offline W&B run in ``RUN_DIR`` (package ``wandb``).

A sink's run-level set-up (the W&B config, the TensorBoard purge step) is given to its
constructor.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Protocol, runtime_checkable

from rltt.errors import RlttError


@runtime_checkable
class MetricSink(Protocol):
    """Receives the numeric metrics of each logged step."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` (name → float, without ``step`` / ``wall_time``) at ``step``."""

    def close(self) -> None:
        """Flush and release the sink; called once, by the logger's ``close()``."""


class TensorBoardSink:
    """Scalars to a TensorBoard event file in ``log_dir``.

    ``resume_step``: the checkpoint step a resumed run continues from; TensorBoard then hides
    the events of the steps after it, which the run logs again.
    """

    def __init__(self, log_dir: str | os.PathLike[str], resume_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RlttError(
                "tensorboard logging was requested but the 'tensorboard' package is not "
                "installed (pip install 'rltt[logging]')"
            ) from exc
        # purge_step makes TensorBoard hide the events of the steps a resumed run redoes
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=None if resume_step is None
                                     else resume_step + 1)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """An offline W&B run in ``run_dir`` (``resume="allow"``), with ``config`` as its config."""

    def __init__(self, run_dir: str | os.PathLike[str], project: str = "rltt",
                 name: str | None = None, config: Mapping[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RlttError(
                "wandb logging was requested but the 'wandb' package is not installed "
                "(pip install wandb, or turn wandb logging off)"
            ) from exc
        self._run = wandb.init(project=project, name=name, dir=str(run_dir), mode="offline",
                               config=dict(config or {}), resume="allow")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
