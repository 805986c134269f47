"""A run's metrics as per-key time series, the input of the diagnoses and the plots."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rltt.errors import RlttError
from rltt.telemetry import schema
from rltt.telemetry.metrics_file import METRICS_FILE, scan_metrics


@dataclass
class RunData:
    """The records of one run, merged by step and sorted.

    Records with the same ``step`` (a loop that logs rollout and learner metrics in two
    calls, or a resumed run that re-logged steps) are merged, later values winning.
    Records without a numeric ``step`` are ignored.
    """

    name: str
    path: Path
    records: list[dict[str, Any]]
    truncated_tail: bool = False
    bad_lines: list[int] = field(default_factory=list)
    _cache: dict[str, tuple[np.ndarray, np.ndarray]] | None = field(
        default=None, init=False, repr=False, compare=False)

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str], name: str | None = None) -> "RunData":
        """Load ``RUN_DIR/metrics.jsonl`` (``run_dir`` may also be the file itself).

        Raises :class:`RlttError` naming the path when the directory or file is missing.
        """
        path = Path(run_dir)
        if not path.exists():
            raise RlttError(f"run directory not found: {path}")
        if path.is_dir():
            file = path / METRICS_FILE
            if not file.is_file():
                raise RlttError(f"no {METRICS_FILE} in run directory {path}")
        else:
            file, path = path, path.parent
        scanned = scan_metrics(file)
        return cls.from_records(scanned.records, name=name or path.resolve().name, path=path,
                                truncated_tail=scanned.truncated_tail,
                                bad_lines=scanned.bad_lines)

    @classmethod
    def from_records(cls, records: list[dict[str, Any]], name: str = "run",
                     path: str | os.PathLike[str] = ".", **kwargs: Any) -> "RunData":
        """Build from in-memory records (merged by step, sorted)."""
        by_step: dict[int, dict[str, Any]] = {}
        for record in records:
            step = record.get(schema.STEP)
            if not isinstance(step, numbers.Real) or isinstance(step, bool):
                continue
            by_step.setdefault(int(step), {}).update(record)
        merged = [by_step[s] | {schema.STEP: s} for s in sorted(by_step)]
        return cls(name=name, path=Path(path), records=merged, **kwargs)

    # ------------------------------------------------------------------ access

    def __len__(self) -> int:
        return len(self.records)

    @property
    def steps(self) -> np.ndarray:
        return np.array([r[schema.STEP] for r in self.records], dtype=np.int64)

    def _columns(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per-key (steps, values) of the numeric entries, built once (records are fixed)."""
        if self._cache is None:
            cols: dict[str, tuple[list[int], list[float]]] = {}
            for record in self.records:
                step = record[schema.STEP]
                for key, value in record.items():
                    if _is_number(value) and key != schema.STEP:
                        steps, values = cols.setdefault(key, ([], []))
                        steps.append(step)
                        values.append(float(value))
            self._cache = {k: (np.array(s, dtype=np.int64), np.array(v, dtype=np.float64))
                           for k, (s, v) in cols.items()}
        return self._cache

    @property
    def keys(self) -> list[str]:
        """Keys with at least one numeric value, sorted (``step``/``wall_time`` excluded)."""
        return sorted(k for k in self._columns() if k != schema.WALL_TIME)

    def has(self, key: str) -> bool:
        return key in self._columns()

    def series(self, key: str, finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of the records where ``key`` is a number.

        ``finite=True`` drops NaN/inf values; ``finite=False`` keeps them.
        """
        empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64))
        steps, values = self._columns().get(key, empty)
        if finite:
            ok = np.isfinite(values)
            steps, values = steps[ok], values[ok]
        return steps, values

    def last(self, key: str) -> float | None:
        """The latest finite value of ``key``, or None."""
        _, values = self.series(key)
        return float(values[-1]) if len(values) else None

    def indexed(self, template: str) -> dict[int, str]:
        """This run's keys instantiating an integer template (e.g. ``schema.EXIT_P``)."""
        return schema.indexed(self.keys, template)

    def named(self, template: str) -> dict[str, str]:
        """This run's keys instantiating a name template (e.g. ``schema.REWARD_FN``)."""
        return schema.named(self.keys, template)

    @property
    def step_range(self) -> tuple[int, int] | None:
        if not self.records:
            return None
        return int(self.records[0][schema.STEP]), int(self.records[-1][schema.STEP])


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
