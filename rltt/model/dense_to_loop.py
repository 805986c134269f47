"""Dense-to-loop conversion: wrap a transformers Qwen3 / Qwen2 / Llama causal LM as a looped model.

The dense layers become the shared block (same arithmetic, same parameter names, weights
copied), and the loop parts — exit gate, optional injection scalar — are added fresh. With
``num_loops=1`` and ``injection="none"`` the looped model computes exactly the dense logits.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from rltt.errors import RlttError
from rltt.model.configuration import LoopConfig
from rltt.model.modeling import LoopedForCausalLM

SUPPORTED = ("qwen3", "qwen2", "llama", "mistral")
# parameters the looped model adds to a dense one
LOOP_ONLY = ("model.exit_gate.weight", "model.exit_gate.bias", "model.injection_logit")


def loop_config_from_dense(dense_config, **loop_settings) -> LoopConfig:
    """A `LoopConfig` with the dense model's layer hyper-parameters and the given loop settings."""
    kind = dense_config.model_type
    if kind not in SUPPORTED:
        raise RlttError(f"loopify: model_type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
    rope = getattr(dense_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise RlttError(f"loopify: rope_type {rope.get('rope_type')!r} is not supported (only default RoPE)")
    if getattr(dense_config, "use_sliding_window", False) or (
        kind == "mistral" and getattr(dense_config, "sliding_window", None)
    ):
        raise RlttError("loopify: sliding-window attention is not supported")
    heads = dense_config.num_attention_heads
    fields = dict(
        vocab_size=dense_config.vocab_size,
        hidden_size=dense_config.hidden_size,
        intermediate_size=dense_config.intermediate_size,
        num_hidden_layers=dense_config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(dense_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(dense_config, "head_dim", None) or dense_config.hidden_size // heads,
        hidden_act=dense_config.hidden_act,
        max_position_embeddings=dense_config.max_position_embeddings,
        rms_norm_eps=dense_config.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(dense_config, "rope_theta", 10000.0))),
        tie_word_embeddings=bool(getattr(dense_config, "tie_word_embeddings", False)),
        qk_norm=kind == "qwen3",
        attention_bias=True if kind == "qwen2" else bool(getattr(dense_config, "attention_bias", False)),
        attention_out_bias=False if kind == "qwen2" else bool(getattr(dense_config, "attention_bias", False)),
        mlp_bias=bool(getattr(dense_config, "mlp_bias", False)),
        pad_token_id=dense_config.pad_token_id,
        bos_token_id=dense_config.bos_token_id,
        eos_token_id=dense_config.eos_token_id,
        norm_placement="pre",
        final_norm="rmsnorm",
    )
    fields.update(loop_settings)
    return LoopConfig(**fields)


def loopify(
    source: str | Path | PreTrainedModel,
    *,
    num_loops: int = 3,
    injection: str = "scalar",
    injection_init: float = 4.6,
    carry_normed_state: bool = True,
    exit_policy: str = "final",
    gate_bias: float = 0.0,
    lora_rank: int = 0,
    dtype: torch.dtype | None = None,
) -> LoopedForCausalLM:
    """Convert a dense HF causal LM (a local path or a model object) into a `LoopedForCausalLM`.

    The gate starts with zero weights and bias ``gate_bias`` (λ = σ(gate_bias) at every step).
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise RlttError(f"loopify: no such checkpoint directory: {path}")
        dense = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    else:
        dense = source
    config = loop_config_from_dense(
        dense.config,
        num_loops=num_loops,
        injection=injection,
        injection_init=injection_init,
        carry_normed_state=carry_normed_state,
        exit_policy=exit_policy,
        lora_rank=lora_rank,
    )
    model = LoopedForCausalLM(config).to(dtype=next(dense.parameters()).dtype)
    model.load_mapped_weights(dense.state_dict(), "loopify", allowed_missing=LOOP_ONLY)
    with torch.no_grad():
        model.model.exit_gate.weight.zero_()
        model.model.exit_gate.bias.fill_(gate_bias)
    return model
