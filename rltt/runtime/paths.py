"""Output paths that never clobber inputs.

Every command that writes checks its output paths first, before any work starts:
:func:`check_run_dir` for a run directory (``logging.run_dir``) and
:func:`check_output_file` for a single output file (``rltt curate --out`` / ``--kept``). Both
refuse, with a one-line `RlttError` naming the key, a path that is (or whose written files
would be) one of the command's inputs: the data source, the recipe file, a model directory.
A run never writes the user's recipe file: its resolved recipe goes to
``RUN_DIR/recipe.resolved.yaml`` (:data:`RESOLVED_RECIPE`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Mapping

from rltt.errors import RlttError
from rltt.telemetry.metrics_file import METRICS_FILE, RESOLVED_RECIPE

#: What a run writes at the top of its directory (files, then directories).
RUN_FILES = (METRICS_FILE, RESOLVED_RECIPE, "alarms.jsonl", "summary.json", "reward_errors.jsonl",
             "metrics.jsonl.tmp")
RUN_DIRS = ("checkpoints", "final", "tensorboard")


def _existing(inputs: Mapping[str, str | Path | None]) -> dict[str, Path]:
    """The inputs that are local paths, resolved (hub ids, ``synthetic:…`` and None drop out)."""
    out = {}
    for label, value in inputs.items():
        if value is None or value == "":
            continue
        path = Path(value).expanduser()
        if path.exists():
            out[label] = path.resolve()
    return out


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_run_dir(run_dir: str | Path, key: str, inputs: Mapping[str, str | Path | None] = (),
                  files: Iterable[str] = RUN_FILES, dirs: Iterable[str] = RUN_DIRS) -> Path:
    """``run_dir`` if the run may write there: not a file, not an input, and none of the files
    it writes (``files``, and anything under ``dirs``) is an input.

    ``inputs``: ``{label: path}``, e.g. ``{"data.source": ..., "the recipe file": ...}``.
    """
    run_dir = Path(run_dir).expanduser()
    if run_dir.exists() and not run_dir.is_dir():
        raise RlttError(f"{key}: {run_dir} is a file, not a directory; choose another {key}")
    root = run_dir.resolve()
    for label, path in _existing(dict(inputs or {})).items():
        if path == root:
            raise RlttError(f"{key}: {run_dir} is {label}; choose another {key}")
        if path.parent == root and path.name in set(files):
            raise RlttError(f"{key}: the run would overwrite {label} {path}; choose another {key}")
        for name in dirs:
            if _within(path, root / name):
                raise RlttError(f"{key}: the run would write over {label} {path}; choose another {key}")
    return run_dir


def check_output_file(path: str | Path, key: str, inputs: Mapping[str, str | Path | None] = (),
                      owned: Callable[[Path], bool] | None = None) -> Path:
    """``path`` if a command may write the file: not a directory, not an input (nor inside an
    input directory), and — when it exists and ``owned`` is given — a file this command wrote
    (``owned(path)`` True); an existing file of any other kind is never replaced."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_file():
        raise RlttError(f"{key}: {path} is not a file")
    target = path.resolve()
    for label, source in _existing(dict(inputs or {})).items():
        if _within(target, source):
            what = "is" if target == source else "is inside"
            raise RlttError(f"{key}: {path} {what} {label}; writing it would destroy an input — choose another {key}")
    if path.exists() and owned is not None and not owned(path):
        raise RlttError(f"{key}: {path} exists and was not written by this command; it is left untouched "
                        f"(move it away or choose another {key})")
    return path
