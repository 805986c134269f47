"""Model shapes from a config.json alone — no weights: the `LoopConfig` rltt would build from
it, the exact parameter count and the rollout KV bytes per token.

Three kinds of config.json, dispatched on ``model_type`` as `rltt.model.load.load_looped` does:

- ``rltt_looped``: rltt's own `LoopConfig`, as saved;
- ``ouro``: mapped by `rltt.model.ouro.ouro_to_loop_config` (``total_ut_steps`` → ``num_loops``,
  sandwich norms, carried final norm, no injection);
- ``qwen3 | qwen2 | llama | mistral``: a dense model that ``model.convert`` (the keyword
  arguments of `rltt.model.dense_to_loop.loopify`) turns into a looped one, mapped by
  `loop_config_from_dense` with loopify's defaults for what the recipe leaves out (T = 3,
  scalar injection).

Parameter count, equal to ``sum(p.numel() for p in LoopedForCausalLM(config).parameters())``
(q = Hq·D, kv = Hkv·D; [x] is 1 when x holds)::

    P       = V·d·(1 + [untied head]) + L·P_layer + d·[final_norm = rmsnorm] + (d + 1) + [injection = scalar]
    P_layer = 2·d·q + 2·d·kv + (q + 2·kv)·[attention_bias] + d·[attention_out_bias] + 2·D·[qk_norm]
              + 3·d·F + (2·F + d)·[mlp_bias] + d·(2 pre | 2 post | 4 sandwich/ouro)
              + Σ over LoRA targets n·r·(fan_in + fan_out)   (n = T per loop step, 1 shared)

KV bytes per token, all T·L (step, layer) slots: ``T·L · 2 · Hkv · D · bytes(dtype)`` — what the
native engine's `rltt.rollout.kv_cache.StepKVCache` preallocates per (row, position).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from rltt.errors import RlttError
from rltt.model.configuration import LoopConfig

DENSE_TYPES = ("qwen3", "qwen2", "llama", "mistral")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The numbers memory depends on, read from a `LoopConfig` (``kind``: rltt | ouro | dense)."""

    kind: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    loops: int
    tied: bool
    placement: str  # pre | post | sandwich (ouro is sandwich)
    qk_norm: bool
    attention_bias: bool
    attention_out_bias: bool
    mlp_bias: bool
    final_norm: bool
    injection: bool  # scalar injection
    lora_rank: int
    lora_targets: tuple[str, ...]
    max_positions: int
    lora_per_loop: bool = True  # T adapters per target (step-wise) or one shared by every step

    @classmethod
    def of(cls, config: LoopConfig, kind: str = "rltt") -> "ModelShape":
        return cls(kind=kind, vocab=config.vocab_size, hidden=config.hidden_size,
                   intermediate=config.intermediate_size, layers=config.num_hidden_layers,
                   heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                   head_dim=config.head_dim, loops=config.num_loops, tied=bool(config.tie_word_embeddings),
                   placement="sandwich" if config.norm_placement == "ouro" else config.norm_placement,
                   qk_norm=bool(config.qk_norm), attention_bias=bool(config.attention_bias),
                   attention_out_bias=bool(config.attention_out_bias), mlp_bias=bool(config.mlp_bias),
                   final_norm=config.final_norm == "rmsnorm", injection=config.injection == "scalar",
                   lora_rank=config.lora_rank, lora_targets=tuple(config.lora_targets or ()),
                   max_positions=config.max_position_embeddings, lora_per_loop=bool(config.lora_per_loop))

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def norms_per_layer(self) -> int:
        return 4 if self.placement == "sandwich" else 2

    @property
    def slots(self) -> int:
        """T·L: the (step, layer) KV slots."""
        return self.loops * self.layers

    def projections(self) -> dict[str, tuple[int, int]]:
        """(fan_in, fan_out) of each projection of one layer."""
        d, q, kv, f = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
                "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}

    def layer_parameters(self) -> int:
        d, q, kv, f = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        count = sum(i * o for i, o in self.projections().values())
        count += (q + 2 * kv) * self.attention_bias + d * self.attention_out_bias + 2 * self.head_dim * self.qk_norm
        count += (2 * f + d) * self.mlp_bias + self.norms_per_layer * d
        return count + self.layer_adapter_parameters()

    @property
    def adapters_per_target(self) -> int:
        """n: LoRA adapters per target projection (T per loop step, or 1 shared)."""
        return self.loops if self.lora_per_loop else 1

    def layer_adapter_parameters(self) -> int:
        """The LoRA adapters of one layer: Σ over targets n·r·(fan_in + fan_out) (0 without)."""
        if not self.lora_rank:
            return 0
        return sum(self.adapters_per_target * self.lora_rank * (i + o) for name, (i, o) in self.projections().items()
                   if name in self.lora_targets)

    @property
    def adapter_parameters(self) -> int:
        """Every LoRA adapter parameter of the model: L · `layer_adapter_parameters`."""
        return self.layers * self.layer_adapter_parameters()

    def vllm_lora_slot_parameters(self, slot_rank: int) -> int:
        """What vLLM's LoRA layers hold for one adapter slot of rank ``slot_rank`` (`rltt.vllm.lora`):
        vLLM wraps every projection of every layer, whatever the adapter targets, each with A
        (slot_rank, in) and B (out, slot_rank) — L · slot_rank · Σ (fan_in + fan_out), one device."""
        return self.layers * slot_rank * sum(i + o for i, o in self.projections().values())

    @property
    def largest_adapter_parameters(self) -> int:
        """The largest adapter tensor, ``lora_A`` (n, r, in) or ``lora_B`` (n, out, r): n·r·max(in, out)."""
        return max((self.adapters_per_target * self.lora_rank * max(i, o) for name, (i, o) in self.projections().items()
                    if name in self.lora_targets), default=0)

    @property
    def fused_parameters(self) -> int:
        """Elements of the concatenated q/k/v weights (and biases) a native engine's model holds for
        decoding (`rltt.model.layers.FusedWeights`): L·(q + 2·kv)·(d + [attention_bias]); 0 with a
        step-wise LoRA on q, k or v (decoding then keeps three projections)."""
        if self.lora_rank and {"q_proj", "k_proj", "v_proj"} & set(self.lora_targets):
            return 0
        return self.layers * (self.q_dim + 2 * self.kv_dim) * (self.hidden + self.attention_bias)

    @property
    def parameters(self) -> int:
        """The exact number of parameters of `LoopedForCausalLM` (a tied head counted once)."""
        d = self.hidden
        return (self.vocab * d * (1 if self.tied else 2) + self.layers * self.layer_parameters()
                + d * self.final_norm + (d + 1) + self.injection)

    @property
    def largest_module_parameters(self) -> int:
        """Parameters of the largest module (what ZeRO-3 gathers at once): a layer or the V×d matrix."""
        return max(self.layer_parameters(), self.vocab * self.hidden)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Rollout KV of one (row, position) over all T·L slots: T·L·2·Hkv·D·bytes."""
        return self.slots * 2 * self.kv_heads * self.head_dim * dtype_bytes


def loop_config_from_json(config: dict, convert: dict | None = None) -> tuple[LoopConfig, str]:
    """``(LoopConfig, kind)`` for a config.json's contents (see the module docstring); ``convert``:
    the recipe's ``model.convert`` (used for dense configs only)."""
    if not isinstance(config, dict):
        raise RlttError(f"model config: expected a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    try:
        if model_type == "rltt_looped":
            return LoopConfig.from_dict(dict(config)), "rltt"
        if model_type == "ouro":
            from rltt.model.ouro import ouro_to_loop_config

            return ouro_to_loop_config(config), "ouro"
        if model_type in DENSE_TYPES:
            return _dense_loop_config(config, convert or {}), "dense"
    except (KeyError, TypeError, ValueError) as exc:
        raise RlttError(f"model config: cannot read the {model_type} shapes ({type(exc).__name__}: {exc})") from None
    raise RlttError(f"model config: unsupported model_type {model_type!r} "
                    f"(rltt_looped, ouro or a dense {' | '.join(DENSE_TYPES)})")


def _dense_loop_config(config: dict, convert: dict) -> LoopConfig:
    from transformers import AutoConfig

    from rltt.model.dense_to_loop import loop_config_from_dense, loopify

    fields = {k: v for k, v in config.items() if k != "model_type"}
    dense = AutoConfig.for_model(config["model_type"], **fields)
    defaults = {name: p.default for name, p in inspect.signature(loopify).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("gate_bias", "dtype")}
    unknown = sorted(set(convert) - set(defaults) - {"gate_bias", "dtype"})
    if unknown:
        raise RlttError(f"recipe key 'model.convert.{unknown[0]}': not a loopify setting "
                        f"(known: {', '.join(sorted(defaults))}, gate_bias, dtype)")
    settings = {**defaults, **{k: v for k, v in convert.items() if k in defaults}}
    return loop_config_from_dense(dense, **settings)


def model_shape(config: dict, convert: dict | None = None) -> ModelShape:
    """The `ModelShape` of a config.json's contents."""
    loop_config, kind = loop_config_from_json(config, convert)
    return ModelShape.of(loop_config, kind)
