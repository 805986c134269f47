"""Device selection for every run (RL training, pretraining, conversion, evaluation)."""

from __future__ import annotations

import torch

from rltt.errors import RlttError


def pick_device(name: str, key: str = "model.device") -> torch.device:
    """``auto`` (CUDA when available, else CPU) or a torch device name; ``key`` names the recipe
    key in the error for a CUDA device on a machine without CUDA."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RlttError(f"{key}={name!r} but CUDA is not available")
    return torch.device(name)
