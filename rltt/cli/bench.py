"""``rltt bench NAME [ARGS ...]``: run one of the benchmark scripts in ``bench/`` (a source checkout).

Each benchmark measures against a baseline in the same run and prints ratios; ``--write``
(where a script supports it) records the figures in ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from rltt.errors import RlttError

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def available() -> list[str]:
    """The benchmarks: scripts ``bench/NAME.py`` and packages ``bench/NAME/`` with a ``__main__.py``
    (``_NAME.py``: a module the scripts share, not a benchmark)."""
    if not BENCH_DIR.is_dir():
        return []
    return sorted({p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_")}
                  | {p.parent.name for p in BENCH_DIR.glob("*/__main__.py")})


def script(name: str) -> Path | None:
    """What ``python`` runs for benchmark ``name``: ``bench/NAME.py``, or the folder ``bench/NAME/`` of a
    package with a ``__main__.py``; None when there is neither."""
    if (BENCH_DIR / f"{name}.py").is_file():
        return BENCH_DIR / f"{name}.py"
    if (BENCH_DIR / name / "__main__.py").is_file():
        return BENCH_DIR / name
    return None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help=f"run a benchmark from bench/ ({', '.join(available()) or 'none'})")
    parser.add_argument("name", help="benchmark name: " + (", ".join(available()) or "(no bench/ directory)"))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark script")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = script(args.name)
    if path is None:
        names = ", ".join(available()) or f"none: {BENCH_DIR} does not exist (benchmarks need a source checkout)"
        raise RlttError(f"bench: unknown benchmark {args.name!r} (available: {names})")
    return subprocess.call([sys.executable, str(path), *args.args], cwd=BENCH_DIR.parent)
