"""A run's metrics file, ``RUN_DIR/metrics.jsonl``: one JSON object per step, one per line.

- :class:`MetricsWriter` appends records (one flushed line each) and, when a run is reopened,
  drops what a resume redoes (:func:`truncate_metrics`) or a line torn by a crash.
- :func:`read_metrics` / :func:`scan_metrics` read the file back, tolerating a truncated
  last line (a run still writing, or one killed mid-write).
- :func:`flatten` and :func:`to_json_value` turn a step's metrics into a JSON-ready record.
"""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from rltt.errors import RlttError
from rltt.telemetry import schema

METRICS_FILE = "metrics.jsonl"
#: The resolved recipe a run writes beside its metrics (the user's recipe file is never written).
RESOLVED_RECIPE = "recipe.resolved.yaml"
#: The python tool's isolation layers, as the run found them at its start (docs/tools.md).
ISOLATION_FILE = "isolation.json"


# --------------------------------------------------------------------------- reading


@dataclass
class MetricsFile:
    """What :func:`scan_metrics` found in a metrics file."""

    path: Path
    records: list[dict[str, Any]]
    #: 1-based line numbers of lines that were not valid JSON objects (the truncated tail
    #: included).
    bad_lines: list[int] = field(default_factory=list)
    #: True when the last line had no newline and did not parse: a write in progress.
    truncated_tail: bool = False


def metrics_path(run_dir_or_file: str | os.PathLike[str]) -> Path:
    """``RUN_DIR/metrics.jsonl``, or the path itself when it names a file."""
    path = Path(run_dir_or_file)
    return path if path.suffix == ".jsonl" or path.is_file() else path / METRICS_FILE


def scan_metrics(path: str | os.PathLike[str]) -> MetricsFile:
    """Read a metrics file (or ``RUN_DIR``), keeping every line that parses as a JSON object.

    A last line without a trailing newline that does not parse is a record still being
    written and is dropped silently (``truncated_tail``); other bad lines are skipped and
    listed in ``bad_lines``. Keys an older run logged under a former name
    (:data:`rltt.telemetry.schema.RENAMED`) come back under their current one. Raises
    :class:`RlttError` when the file does not exist.
    """
    path = metrics_path(path)
    if not path.is_file():
        raise RlttError(f"no metrics file at {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    ends_with_newline = text.endswith("\n")
    if ends_with_newline:
        lines.pop()  # the empty string after the final newline
    result = MetricsFile(path=path, records=[])
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            result.records.append(schema.current_names(record))  # an older run's renamed keys
            continue
        result.bad_lines.append(number)
        if number == len(lines) and not ends_with_newline:
            result.truncated_tail = True
    return result


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` (or of the file ``path``), in file order.

    Tolerates a truncated last line (see :func:`scan_metrics`).
    """
    return scan_metrics(path).records


def truncate_metrics(path: str | os.PathLike[str], max_step: int) -> int:
    """Drop the records with ``step > max_step`` (and unparsable lines) from a metrics file.

    Used when a run resumes from the checkpoint of ``max_step``: the steps logged after that
    checkpoint are about to be redone. The file is rewritten atomically. Returns the number
    of records removed.
    """
    scanned = scan_metrics(path)
    kept = [r for r in scanned.records if not _is_after(r, max_step)]
    tmp = scanned.path.with_name(scanned.path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in kept:
            f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, scanned.path)
    return len(scanned.records) - len(kept)


def _is_after(record: Mapping[str, Any], max_step: int) -> bool:
    step = record.get(schema.STEP)
    return isinstance(step, numbers.Real) and step > max_step


# --------------------------------------------------------------------------- writing


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts into ``/``-joined keys.

    ``{"reward": {"mean": 1}}`` becomes ``{"reward/mean": 1}``.
    """
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        full = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, full))
        else:
            flat[full] = value
    return flat


def to_json_value(value: Any) -> Any:
    """A JSON-ready scalar: 0-d tensors / numpy scalars become Python numbers.

    bool stays bool, int stays int, floats stay floats (NaN/inf are kept; Python's json reads
    them back). Strings and None pass through. Anything else raises TypeError.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metric tensors must have one element, got shape {tuple(value.shape)}")
        value = value.detach().cpu().item()
    elif hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar / 0-d array
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric value of type {type(value).__name__} is not a scalar")


class MetricsWriter:
    """Appends records to ``RUN_DIR/metrics.jsonl``, one flushed line each (see
    :class:`~rltt.telemetry.logger.MetricsLogger` for ``resume_step``)."""

    def __init__(self, run_dir: str | os.PathLike[str], resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        if resume_step is not None and self.path.exists():
            # step 0 = no checkpoint: every record is redone, the step-0 (initial eval) one included
            truncate_metrics(self.path, resume_step if resume_step > 0 else -1)
        elif self.path.exists():
            _drop_partial_tail(self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    @property
    def closed(self) -> bool:
        return self._file.closed

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one JSON line and flush it, so readers see it at once."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._file.closed:
            self._file.close()


def _drop_partial_tail(path: Path) -> None:
    """Remove a trailing line without newline that is not valid JSON (a crash mid-write)."""
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1
        try:
            json.loads(data[cut:])
        except ValueError:
            f.truncate(cut)
        else:  # a complete record that only lacks its newline
            f.write(b"\n")
