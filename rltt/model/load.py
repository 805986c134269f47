"""Load any supported checkpoint as a looped model: rltt's own, Ouro's, or a dense one to convert."""

from __future__ import annotations

from pathlib import Path

import torch

from rltt.errors import RlttError
from rltt.model.dense_to_loop import SUPPORTED, loopify
from rltt.model.model_source import CONFIG_FILE, ModelSource
from rltt.model.modeling import LoopedForCausalLM
from rltt.model.ouro import load_ouro


def load_looped(path: str | Path, dtype: torch.dtype | None = None, **convert_settings) -> LoopedForCausalLM:
    """Load a checkpoint directory by its ``model_type``: ``rltt_looped`` (from_pretrained),
    ``ouro`` (weight mapping) or a dense Qwen3/Qwen2/Llama (`loopify` with ``convert_settings``)."""
    path = Path(path)
    model_type = ModelSource.read(path, "model").model_type
    if model_type == "rltt_looped":
        return LoopedForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    if model_type == "ouro":
        return load_ouro(path, dtype=dtype)
    if model_type in SUPPORTED:
        return loopify(path, dtype=dtype, **convert_settings)
    raise RlttError(f"model: {path / CONFIG_FILE} has unsupported model_type {model_type!r}")
