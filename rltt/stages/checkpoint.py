"""Atomic checkpoints of the LM stages and the state that makes ``--resume`` exact.

A checkpoint is a directory ``RUN_DIR/checkpoints/step-XXXXXXX`` holding the model
(``save_pretrained``, safetensors), the tokenizer, ``recipe.yaml`` and ``trainer_state.pt``
(optimizer, LR scheduler, RNG states, data position, alarm state, counters). It is written
into a temporary directory beside it and moved into place with ``os.replace``, so a crash
leaves either the whole checkpoint or none of it.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import torch
import yaml

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:07d}"


def list_checkpoints(run_dir: str | Path, state_file: str = STATE_FILE) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run (those holding ``state_file``), oldest first."""
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
    found = list_checkpoints(run_dir, state_file)
    return found[-1][1] if found else None


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
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


def atomic_dir(final: Path, write) -> Path:
    """Call ``write(tmp_dir)`` then move ``tmp_dir`` to ``final`` (replacing an old one)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    write(tmp)
    if final.exists():  # os.replace cannot overwrite a non-empty directory
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    return final


def save_checkpoint(run_dir: str | Path, step: int, model, tokenizer, trainer_state: dict,
                    recipe: dict, keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically; keep the newest ``keep`` checkpoints."""

    def write(tmp: Path) -> None:
        write_model_dir(tmp, model, tokenizer, recipe)
        torch.save({**trainer_state, "rng": rng_state(), "step": step}, tmp / STATE_FILE)

    path = atomic_dir(checkpoint_dir(run_dir, step), write)
    for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_trainer_state(path: Path) -> dict:
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
