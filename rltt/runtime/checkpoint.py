"""Atomic, validated checkpoints of the training loops and the state that makes ``--resume`` exact.

A checkpoint is a directory ``RUN_DIR/checkpoints/step-XXXXXXX`` holding the model
(``save_pretrained``, safetensors), the tokenizer, ``recipe.yaml``, the loop's state file
(``trainer_state.pt`` here: optimizer, LR scheduler, RNG states, data position, alarm state,
counters) and, written last, ``manifest.json``: the size and sha256 of every other file. It is
written into a temporary directory beside it and moved into place with ``os.replace``, so a
crash leaves either the whole checkpoint or none of it.

Nothing in a checkpoint can run code: weights are safetensors, the rest JSON/YAML, and the
``.pt`` state files are read with ``torch.load(weights_only=True)`` (tensors and plain data
only); :func:`load_state_file` refuses anything else with a one-line error.

:func:`latest_checkpoint` returns the newest checkpoint that passes :func:`validate_checkpoint`
(a warning names each newer one it skips: a missing or truncated file, a hash mismatch);
:func:`clean_stale` removes what killed writes left (``.tmp-*``, ``.staged-*``, ``.old-*``);
:func:`prune_checkpoints` keeps the newest ``keep_last`` (and every ``keep_every``-th step).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import struct
import sys
from pathlib import Path

import torch
import yaml

from rltt.errors import RlttError

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
#: the file of a LoRA run's checkpoint naming its base (path, dtype, sha256 of its tensors): such a
#: checkpoint holds the adapters (``adapter/``) and no ``model.safetensors``
BASE_FILE = "base.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_STALE = (".tmp-", ".staged-", ".old-")


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:07d}"


def list_checkpoints(run_dir: str | Path, state_file: str = STATE_FILE) -> list[tuple[int, Path]]:
    """Checkpoints of a run that hold ``state_file`` (not yet validated), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _STEP_DIR.match(path.name)
        if m and (path / state_file).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path, state_file: str = STATE_FILE) -> Path | None:
    """The newest valid checkpoint; each newer invalid one is skipped with a warning."""
    for _, path in reversed(list_checkpoints(run_dir, state_file)):
        reason = validate_checkpoint(path, state_file)
        if reason is None:
            return path
        print(f"WARNING: skipping checkpoint {path}: {reason}; falling back to an earlier one", file=sys.stderr)
    return None


def require_run(run_dir: str | Path, key: str, state_file: str = STATE_FILE) -> None:
    """``--resume`` needs a run in ``run_dir`` (its metrics file or a checkpoint): one-line error if not."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise RlttError(f"{key}: {run_dir} is a file, not a run directory")
    if not (run_dir / "metrics.jsonl").is_file() and not list_checkpoints(run_dir, state_file):
        raise RlttError(f"--resume: no run in {key}={run_dir} (no metrics.jsonl, no checkpoint); "
                        f"start it without --resume")


# --------------------------------------------------------------------------- manifest, validation


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(path: Path) -> Path:
    """``path/manifest.json``: size and sha256 of every file under ``path`` (write it last)."""
    path = Path(path)
    files = {p.relative_to(path).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _files(path)}
    target = path / MANIFEST
    target.write_text(json.dumps({"files": files}, indent=1, sort_keys=True) + "\n")
    return target


def _safetensors_complete(path: Path) -> str | None:
    """A structural check of a safetensors file: header readable, data as long as it says."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return f"{path.name} is truncated"
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError):
        return f"{path.name} has no readable safetensors header"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) > size:
        return f"{path.name} is truncated ({size} bytes, its header needs {8 + n + max(ends)})"
    return None


def validate_checkpoint(path: str | Path, state_file: str = STATE_FILE) -> str | None:
    """Why checkpoint ``path`` cannot be resumed from, or None when it is complete.

    With a manifest every listed file must be there with its size and sha256; without one
    (checkpoints of older versions) the state file and the model weights must be there. Either
    way the safetensors files must be structurally complete. A LoRA checkpoint (``base.json``)
    holds its adapters' safetensors instead of the model's.
    """
    path = Path(path)
    if not (path / state_file).is_file():
        return f"no {state_file}"
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return f"{MANIFEST} is unreadable"
        for name, info in files.items():
            file = path / name
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != info["size"]:
                return f"{name} has {file.stat().st_size} bytes, the manifest says {info['size']}"
        for name, info in files.items():
            if _sha256(path / name) != info["sha256"]:
                return f"{name} does not match its sha256 in {MANIFEST}"
    weights = sorted(path.rglob("*.safetensors"))
    if (path / BASE_FILE).is_file():
        if not weights:
            return f"no adapter weights beside {BASE_FILE}"
    elif not (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").is_file():
        return "no model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return f"{index.name} is unreadable"
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            return f"{missing[0]} is missing"
    for file in weights:
        reason = _safetensors_complete(file)
        if reason:
            return reason
    return None


# --------------------------------------------------------------------------- state files


def load_state_file(path: str | Path) -> dict:
    """A ``.pt`` state file read with ``weights_only=True``: tensors and plain data only.

    Anything else (a pickle that would import or call code) and unreadable files are a
    one-line `RlttError`; nothing in the file runs.
    """
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RlttError(f"refusing to load {path}: it holds more than tensors and plain data, so loading it could "
                        f"run code ({first[:160]})") from None
    except FileNotFoundError:
        raise RlttError(f"checkpoint file not found: {path}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RlttError(f"checkpoint file {path} is unreadable (truncated or corrupt: {first[:160]})") from None


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    python = state["python"]  # a list after a JSON/weights-only round trip; random wants tuples
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_model_dir(path: Path, model, tokenizer, recipe: dict | None = None, state_dict: dict | None = None) -> None:
    """``save_pretrained`` of model and tokenizer (+ the recipe) into ``path``; ``state_dict``
    replaces the model's own tensors (e.g. weights gathered from ZeRO-3 partitions)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(path)
    if recipe is not None:
        (path / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))


def atomic_dir(final: Path, write, manifest: bool = True) -> Path:
    """Call ``write(tmp_dir)``, add the manifest, then move ``tmp_dir`` to ``final`` (replacing an old one)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    write(tmp)
    if manifest:
        write_manifest(tmp)
    if final.exists():  # os.replace cannot overwrite a non-empty directory
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    return final


def clean_stale(*dirs: str | Path) -> list[Path]:
    """Remove what killed writes left in ``dirs``: ``.tmp-*`` / ``.staged-*`` directories, and
    ``.old-NAME-*`` ones whose ``NAME`` exists (one whose ``NAME`` is missing — a kill between
    the two renames of :func:`atomic_dir` — is moved back). Returns what was removed."""
    removed = []
    for root in dirs:
        root = Path(root)
        if not root.is_dir():
            continue
        for path in sorted(root.iterdir()):
            if not path.name.startswith(_STALE):
                continue
            if path.name.startswith(".old-"):
                name = path.name[len(".old-"):].rsplit("-", 1)[0]
                if not (root / name).exists():
                    os.replace(path, root / name)
                    continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def prune_checkpoints(run_dir: str | Path, keep_last: int = 3, keep_every: int = 0,
                      state_file: str = STATE_FILE) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (0 = keep all) and those whose step
    is a multiple of ``keep_every`` (0 = none); returns the deleted ones."""
    if keep_last <= 0:
        return []
    found = list_checkpoints(run_dir, state_file)
    deleted = []
    for step, path in found[:-keep_last]:
        if keep_every > 0 and step % keep_every == 0:
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def save_checkpoint(run_dir: str | Path, step: int, model, tokenizer, trainer_state: dict,
                    recipe: dict, keep_last: int = 3, keep_every: int = 0) -> Path:
    """Write checkpoint ``step`` atomically; then apply the retention of :func:`prune_checkpoints`."""

    def write(tmp: Path) -> None:
        write_model_dir(tmp, model, tokenizer, recipe)
        torch.save({**trainer_state, "rng": rng_state(), "step": step}, tmp / STATE_FILE)

    path = atomic_dir(checkpoint_dir(run_dir, step), write)
    prune_checkpoints(run_dir, keep_last, keep_every)
    return path


def load_trainer_state(path: Path) -> dict:
    return load_state_file(Path(path) / STATE_FILE)
