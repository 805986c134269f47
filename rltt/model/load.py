"""Load any supported checkpoint as a looped model: rltt's own, Ouro's, a dense one to convert, or a
LoRA run's checkpoint (its adapters, on the base its ``base.json`` names)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rltt.errors import RlttError
from rltt.model.adapters import ADAPTER_DIR, AdapterSpec, attach_adapters, base_identity, is_adapter, read_peft_state
from rltt.model.dense_to_loop import SUPPORTED, loopify
from rltt.model.model_source import CONFIG_FILE, ModelSource
from rltt.model.modeling import LoopedForCausalLM
from rltt.model.ouro import load_ouro
from rltt.runtime.checkpoint import BASE_FILE


def load_looped(path: str | Path, dtype: torch.dtype | None = None, **convert_settings) -> LoopedForCausalLM:
    """Load a checkpoint directory by its ``model_type``: ``rltt_looped`` (from_pretrained),
    ``ouro`` (weight mapping) or a dense Qwen3/Qwen2/Llama (`loopify` with ``convert_settings``)."""
    path = Path(path)
    if (path / BASE_FILE).is_file():
        return load_adapter_checkpoint(path, dtype, **convert_settings)
    model_type = ModelSource.read(path, "model").model_type
    if model_type == "rltt_looped":
        return LoopedForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    if model_type == "ouro":
        return load_ouro(path, dtype=dtype)
    if model_type in SUPPORTED:
        return loopify(path, dtype=dtype, **convert_settings)
    raise RlttError(f"model: {path / CONFIG_FILE} has unsupported model_type {model_type!r}")


def read_base(path: Path) -> dict[str, str]:
    """The base a LoRA checkpoint names (``path/base.json``: path, dtype, sha256)."""
    file = Path(path) / BASE_FILE
    try:
        info = json.loads(file.read_text(encoding="utf-8"))
        return {key: str(info[key]) for key in ("path", "dtype", "sha256")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RlttError(f"{file} is unreadable ({type(exc).__name__}): it names the LoRA checkpoint's base") from None


def check_base(checkpoint: Path, saved: dict[str, str], base: dict[str, str]) -> None:
    """One line naming both when ``base`` (`base_identity` of a loaded model) is not the base the
    checkpoint was trained on (``saved``)."""
    if base["sha256"] != saved["sha256"]:
        raise RlttError(f"{checkpoint}: holds LoRA adapters trained on the base {saved['path'] or '?'} (sha256 "
                        f"{saved['sha256'][:12]}), but the base {base['path'] or '?'} has other weights (sha256 "
                        f"{base['sha256'][:12]}); load it onto the base it was trained on")


def load_adapter_checkpoint(path: Path, dtype: torch.dtype | None = None, **convert_settings) -> LoopedForCausalLM:
    """A LoRA run's checkpoint as a model: the base ``base.json`` names, loaded in the dtype it was
    hashed in and checked against its sha256, with the checkpoint's adapters (``adapter/``, in the
    shape ``config.json`` declares) attached and loaded; then cast to ``dtype`` (default fp32).
    ``convert_settings`` (a dense base): the recipe's ``model.convert``, else the checkpoint's
    ``recipe.yaml``'s."""
    path = Path(path)
    saved = read_base(path)
    base = Path(saved["path"]) if saved["path"] else None
    if base is None or not (base / CONFIG_FILE).is_file():
        raise RlttError(f"{path}: holds LoRA adapters only, and its base {saved['path'] or '(unnamed)'} is missing; "
                        f"restore the base there (sha256 {saved['sha256'][:12]}) or load a merged model")
    if not convert_settings and (path / "recipe.yaml").is_file():
        import yaml

        recipe = yaml.safe_load((path / "recipe.yaml").read_text(encoding="utf-8")) or {}
        convert_settings = ((recipe.get("model") or {}).get("convert") or {}) if isinstance(recipe, dict) else {}
    stored = getattr(torch, saved["dtype"].split("/")[0], None) if saved["dtype"] else None
    model = load_looped(base, dtype=stored if isinstance(stored, torch.dtype) else None, **convert_settings)
    check_base(path, saved, base_identity(model))
    config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    if not config.get("lora_rank"):
        raise RlttError(f"{path / CONFIG_FILE}: lora_rank is 0 beside {BASE_FILE}: not a LoRA checkpoint")
    spec = AdapterSpec(int(config["lora_rank"]), float(config["lora_alpha"]), tuple(config["lora_targets"]),
                       bool(config["lora_per_loop"]), float(config.get("lora_dropout", 0.0)))
    attach_adapters(model, spec)
    state = read_peft_state(path / ADAPTER_DIR, spec, model.config.num_loops)
    expected = {k for k in model.state_dict() if is_adapter(k)}
    if set(state) != expected:
        raise RlttError(f"{path / ADAPTER_DIR}: its adapters do not match {CONFIG_FILE}'s lora_* settings")
    model.load_state_dict(state, strict=False)
    return model.to(dtype or torch.float32)
