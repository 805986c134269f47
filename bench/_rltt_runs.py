"""What the bench scripts that run ``rltt`` commands share (`bench/algorithms.py`,
`bench/compute.py`): the subprocess call and its environment, the command line as text, reading a
run's metrics and a median that skips what is not a finite number. Not a benchmark itself."""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command(argv: list[str]) -> str:
    """``rltt ARGV`` as a shell command line."""
    return "rltt " + " ".join(shlex.quote(a) for a in argv)


def child_env() -> dict:
    """The environment of an ``rltt`` subprocess: this checkout first on the path, one thread each
    (OpenMP threads stall when other processes share the cores)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def call_rltt(argv: list[str], log: Path, append: bool = False) -> int:
    """Run ``rltt ARGV`` from the repository root, its command line then its output in ``log``."""
    with log.open("a" if append else "w") as f:
        f.write(command(argv) + "\n\n")
        f.flush()
        return subprocess.call([sys.executable, "-m", "rltt.cli.main", *argv], cwd=ROOT, env=child_env(),
                               stdout=f, stderr=subprocess.STDOUT)


def read_records(run_dir: Path) -> list[dict]:
    from rltt.telemetry import read_metrics

    return read_metrics(run_dir)


def median(values) -> float:
    """The median of the finite numbers in ``values`` (NaN if none)."""
    v = sorted(x for x in values if isinstance(x, (int, float)) and math.isfinite(x))
    if not v:
        return float("nan")
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])
