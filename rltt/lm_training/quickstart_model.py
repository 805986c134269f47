"""The quickstart model: a tiny LoopLM pretrained by ``recipes/pretrain-tiny.yaml`` on first use.

:func:`ensure_quickstart_model` returns the path of a model directory loadable with
``rltt.model.load_looped`` (tokenizer included). The first call runs the recipe (about five
minutes on 2 CPU cores) into the cache directory; later calls return the cached checkpoint
at once. An interrupted build resumes from its last checkpoint. A file lock serialises
concurrent callers (e.g. parallel test processes).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

from rltt.errors import RlttError

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "pretrain-tiny.yaml"
CACHE_ENV = "RLTT_CACHE"
READY_FILE = "quickstart.json"


def default_cache_dir() -> Path:
    """``$RLTT_CACHE`` or ``~/.cache/rltt``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rltt")


def _key(overrides: list[str]) -> str:
    """The cache key: a hash of the *resolved* recipe (every value after defaults and overrides)
    without its ``logging`` section, so comments, formatting or a logging setting in the recipe
    file do not rebuild the model, and any value that changes the training does."""
    from rltt.config import to_dict
    from rltt.lm_training.pretraining import load_pretrain_recipe

    resolved = to_dict(load_pretrain_recipe(RECIPE, overrides))
    resolved.pop("logging", None)
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _text_key(recipe_text: str, overrides: list[str]) -> str:
    """The key caches were written under before the resolved-recipe key (still accepted)."""
    return hashlib.sha256((recipe_text + "\0" + "\0".join(overrides)).encode()).hexdigest()[:16]


def ensure_quickstart_model(cache_dir: str | Path | None = None, overrides: Iterable[str] = (),
                            progress: bool = True) -> Path:
    """Path of the quickstart model's directory, building it first if it is not cached.

    ``cache_dir`` defaults to :func:`default_cache_dir`; the model lives in
    ``<cache_dir>/quickstart-model`` (with ``overrides`` — recipe ``key=value`` changes, e.g.
    for a faster test build — in ``quickstart-model-<hash>``). The cache is keyed by the
    resolved recipe (see `_key`), so changing a recipe value rebuilds it and a comment does not.
    """
    from rltt.lm_training.pretraining import load_pretrain_recipe, pretrain

    overrides = list(overrides)
    if not RECIPE.is_file():
        raise RlttError(f"quickstart recipe not found: {RECIPE} (run from an rltt source checkout)")
    key = _key(overrides)
    earlier = _text_key(RECIPE.read_text(encoding="utf-8"), overrides)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    home = root / ("quickstart-model" if not overrides else f"quickstart-model-{key[:8]}")
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ready = _ready(home, (key, earlier))
        if ready is not None:
            _record_key(home, key)
            return ready
        run_dir = home / "run"
        recipe = load_pretrain_recipe(RECIPE, [*overrides, f"logging.run_dir={run_dir}", f"logging.progress={progress}"])
        if not (run_dir / "metrics.jsonl").exists() or not (run_dir / "checkpoints").is_dir():
            _clear(run_dir)  # nothing to resume: start clean
        result = pretrain(recipe, resume=(run_dir / "metrics.jsonl").exists())
        info = {"key": key, "model": str(result.final_dir), "step": result.step,
                "train_seconds": round(result.wall_time_s, 1), "eval": result.eval, "alarms": result.alarms}
        (home / READY_FILE).write_text(json.dumps(info, indent=2) + "\n")
        return Path(result.final_dir)


def quickstart_info(cache_dir: str | Path | None = None) -> dict | None:
    """The build record of the cached default quickstart model (solve rate, exits, time), if any."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / "quickstart-model" / READY_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _ready(home: Path, keys: tuple[str, ...]) -> Path | None:
    path = home / READY_FILE
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text())
    except ValueError:
        return None
    model = Path(info.get("model", ""))
    if info.get("key") not in keys or not (model / "config.json").is_file():
        return None
    return model


def _record_key(home: Path, key: str) -> None:
    """A cache accepted under the earlier text key is recorded under the resolved-recipe key."""
    path = home / READY_FILE
    info = json.loads(path.read_text())
    if info.get("key") != key:
        info["key"] = key
        path.write_text(json.dumps(info, indent=2) + "\n")


def _clear(run_dir: Path) -> None:
    import shutil

    if run_dir.exists():
        shutil.rmtree(run_dir)
