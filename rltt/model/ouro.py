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

#: the hub repository whose remote code (``configuration_ouro.py``, ``modeling_ouro.py``) reads an Ouro
#: checkpoint, and the ``auto_map`` `save_ouro` writes to it (the classes Ouro's own config.json names)
OURO_CODE_REPO = "ByteDance/Ouro-1.4B"
OURO_AUTO_MAP = {"AutoConfig": f"{OURO_CODE_REPO}--configuration_ouro.OuroConfig",
                 "AutoModel": f"{OURO_CODE_REPO}--modeling_ouro.OuroModel",
                 "AutoModelForCausalLM": f"{OURO_CODE_REPO}--modeling_ouro.OuroForCausalLM"}

#: (config field, whether Ouro's format holds the config's value, what Ouro has instead), checked in order
OURO_LAYOUT = (
    ("norm_placement", lambda c: c.norm_placement in ("ouro", "sandwich"),
     "Ouro's layers are sandwich-normed: an RMSNorm before and after attention and the MLP"),
    ("carry_normed_state", lambda c: c.carry_normed_state, "Ouro carries the normed state to the next step"),
    ("injection", lambda c: c.injection == "none", "Ouro feeds step t + 1 the state of step t alone"),
    ("final_norm", lambda c: c.final_norm == "rmsnorm", "Ouro has an RMSNorm after every step"),
    ("qk_norm", lambda c: not c.qk_norm, "Ouro has no q/k norms"),
    ("mlp_bias", lambda c: not c.mlp_bias, "Ouro's MLP has no biases"),
    ("attention_bias", lambda c: not c.attention_bias, "Ouro's attention projections have no biases"),
    ("attention_out_bias", lambda c: not c.attention_out_bias, "Ouro's attention projections have no biases"),
    ("lora_rank", lambda c: not c.lora_rank, "merge the adapters first"),
)


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
    config.name_or_path = str(path)  # what a run's PEFT adapter names as its base
    model = LoopedForCausalLM(config)
    model.load_mapped_weights(state, "load_ouro")
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def loop_to_ouro_config(config: LoopConfig, key: str = "save_ouro") -> dict:
    """The Ouro config.json of a `LoopConfig` Ouro's layout can hold (`OURO_LAYOUT`): the inverse of
    `ouro_to_loop_config`, with an ``auto_map`` to Ouro's own modeling code on the hub (`OURO_AUTO_MAP`).
    Any other config is a one-line error starting with ``key``, naming the first field Ouro cannot express."""
    for name, fits, reason in OURO_LAYOUT:
        if not fits(config):
            raise RlttError(f"{key}: Ouro's format cannot express {name}={getattr(config, name)!r} ({reason})")
    threshold = None
    if config.exit_policy.startswith("threshold:"):
        threshold = float(config.exit_policy.split(":", 1)[1])
    return {"model_type": "ouro", "architectures": ["OuroForCausalLM"], "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
            "hidden_act": config.hidden_act, "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
            "attention_bias": bool(config.attention_bias), "tie_word_embeddings": bool(config.tie_word_embeddings),
            "pad_token_id": config.pad_token_id, "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id, "total_ut_steps": config.num_loops,
            "early_exit_threshold": threshold, "auto_map": dict(OURO_AUTO_MAP)}


def save_ouro(model: LoopedForCausalLM, path: str | Path, key: str = "save_ouro") -> Path:
    """Write ``model`` as an Ouro checkpoint directory (config.json + model.safetensors, Ouro's
    weight names), which `load_ouro` reads back to the same tensors and transformers loads with
    ``trust_remote_code=True`` (its ``auto_map``); ``key`` starts the error of a model Ouro's format
    cannot hold (`loop_to_ouro_config`), raised before anything is written."""
    from safetensors.torch import save_file

    path = Path(path)
    config = loop_to_ouro_config(model.config, key)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, value in model.state_dict().items():
        if name.endswith("rotary_emb.inv_freq") or (config["tie_word_embeddings"] and name == "lm_head.weight"):
            continue
        for old, new in RENAMES.items():
            name = name.replace(new, old)
        state[name] = value.detach().to("cpu").contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return path
