"""Import Ouro checkpoints (HF remote-code layout, `OuroForCausalLM`) without remote code.

Ouro's layer is a sandwich-norm Qwen2-style layer (4 RMSNorms: ``input_layernorm``,
``input_layernorm_2``, ``post_attention_layernorm``, ``post_attention_layernorm_2``); the
final norm is applied after every recurrent step and carried (rltt's ``norm_placement: ouro``),
and the exit gate is ``model.early_exit_gate``. Config fields ``total_ut_steps`` and
``early_exit_threshold`` become ``num_loops`` and the ``threshold:q`` exit policy.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from rltt.errors import RlttError
from rltt.model.configuration import LoopConfig
from rltt.model.model_source import CONFIG_FILE, read_config
from rltt.model.modeling import LoopedForCausalLM

RENAMES = {"model.early_exit_gate.": "model.exit_gate."}


def ouro_to_loop_config(ouro: dict, **overrides) -> LoopConfig:
    heads = ouro["num_attention_heads"]
    rope = ouro.get("rope_parameters") or {}
    threshold = ouro.get("early_exit_threshold")
    fields = dict(
        vocab_size=ouro["vocab_size"],
        hidden_size=ouro["hidden_size"],
        intermediate_size=ouro["intermediate_size"],
        num_hidden_layers=ouro["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=ouro.get("num_key_value_heads") or heads,
        head_dim=ouro.get("head_dim") or ouro["hidden_size"] // heads,
        hidden_act=ouro.get("hidden_act", "silu"),
        max_position_embeddings=ouro.get("max_position_embeddings", 4096),
        rms_norm_eps=ouro.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", ouro.get("rope_theta", 10000.0))),
        attention_bias=bool(ouro.get("attention_bias", False)),
        tie_word_embeddings=bool(ouro.get("tie_word_embeddings", False)),
        pad_token_id=ouro.get("pad_token_id"),
        bos_token_id=ouro.get("bos_token_id"),
        eos_token_id=ouro.get("eos_token_id"),
        num_loops=int(ouro.get("total_ut_steps", 4)),
        norm_placement="ouro",
        injection="none",
        carry_normed_state=True,
        exit_policy=f"threshold:{threshold}" if threshold is not None and 0 < threshold <= 1 else "final",
    )
    fields.update(overrides)
    return LoopConfig(**fields)


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise RlttError(f"load_ouro: no *.safetensors weights in {path}")
    state = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def load_ouro(path: str | Path, dtype: torch.dtype | None = None, **overrides) -> LoopedForCausalLM:
    """Load an Ouro checkpoint directory into a `LoopedForCausalLM` by weight-name mapping."""
    path = Path(path)
    ouro = read_config(path, "load_ouro")
    if ouro.get("model_type") != "ouro":
        raise RlttError(f"load_ouro: {path / CONFIG_FILE} has model_type {ouro.get('model_type')!r}, expected 'ouro'")
    config = ouro_to_loop_config(ouro, **overrides)
    state = {}
    for key, value in _read_state_dict(path).items():
        for old, new in RENAMES.items():
            key = key.replace(old, new)
        state[key] = value
    model = LoopedForCausalLM(config)
    model.load_mapped_weights(state, "load_ouro")
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
