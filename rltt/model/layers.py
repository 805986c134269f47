"""The decoder layer of the shared block: RMSNorm, rotary attention, SwiGLU MLP, step-wise LoRA.

The arithmetic matches transformers' Qwen3/Qwen2/Llama layers operation for operation, so a
converted dense checkpoint gives the same logits at T = 1. Parameter names follow theirs
(and Ouro's for the sandwich norms), so conversion and Ouro import are name mappings.

Attention does not own a cache: each layer hands its (q, k, v) to an ``attend`` callable
(``attend(q, k, v, layer_idx) -> out``) chosen by the caller — the model's forward uses a
per-(step, layer) KV cache slot, the rollout engine its own batched cache.

Decoding (one position per row, no gradients: the rollout engine's passes, ``generate``'s steps)
projects q, k and v with one GEMM over their weights concatenated (`FusedWeights`) and rotates q
and k with one RoPE: 6 fewer operators per layer. Each output element is the same dot product in
the same order as with three GEMMs — bitwise equal on CPU in fp32 and bf16
(tests/model/test_fused_forward.py) — so the rollout computes the learner's function; the
checkpoint keeps its three ``q_proj``/``k_proj``/``v_proj`` weights. (On a GPU the library may pick
another kernel for the wider GEMM; that equality has not been checked there.)
"""

from __future__ import annotations

from typing import Protocol, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from rltt.model.configuration import LoopConfig

Step = Union[int, torch.Tensor]  # a 1-based step for the whole batch, or one per row (LongTensor (B,))


class Attend(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """q (B, Hq, S, D), k/v (B, Hkv, S, D) with rotary applied → output (B, Hq, S, D)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' arithmetic: x in fp32 times rsqrt(mean(x²) + ε), cast back to x's dtype, times
        the weight. `F.rms_norm` is that sequence as one operator (on CPU the same operations, bitwise;
        tests/model/test_fused_forward.py): with the weight in fp32, where the cast back is a no-op;
        without it otherwise — the weight multiplies after the cast, as in transformers."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
        return self.weight * F.rms_norm(x, self.weight.shape, None, self.variance_epsilon)


class RotaryEmbedding(nn.Module):
    """Default RoPE: cos/sin of position · θ^(−2i/D), computed in fp32.

    The inverse frequencies are recomputed on each call (D/2 numbers), so there is no
    non-persistent buffer for checkpoint loading to lose.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim
        return (1.0 / (self.theta**exponent)).to(device)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables `apply_rotary` takes for ``position_ids`` (..., S): ``cos`` and the *signed*
        ``sin`` (its first half negated), both (..., 1, S, D), the head axis ready to broadcast."""
        freqs = position_ids[..., None].float() * self.inv_freq(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = self.head_dim // 2
        sign = torch.cat((-torch.ones(half), torch.ones(half))).to(emb.device)
        return emb.cos().to(dtype).unsqueeze(-3), (emb.sin() * sign).to(dtype).unsqueeze(-3)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x (B, H, S, D) with `RotaryEmbedding`'s tables (B, 1, S, D).

    ``x·cos + rotate_half(x)·sin`` with ``rotate_half(x) = (−x₂, x₁)``: the sign moves into the
    table, ``(−x₂)·sin = x₂·(−sin)`` exactly, so one roll replaces two slices, a negation and a
    concatenation with the same bits (transformers' Qwen/Llama arithmetic).
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class StepLinear(nn.Linear):
    """nn.Linear with an optional LoRA adapter: one per loop step (``per_loop``, the pretraining
    step-wise LoRA, docs/design.md §1) or one shared by every loop step (RL's ``learner.lora``
    with ``per_loop: false``). Off by default.

    ``forward(x, step)``: step is a 1-based int for the whole batch or a LongTensor (B,) giving
    each row its own step (depth-mixed batching). With an adapter the output is
    ``W x + b + scale · B (A dropout(x))``, scale = alpha / rank; ``lora_enabled = False``
    (`rltt.model.adapters.adapters_disabled`) computes ``W x + b`` alone — the base's very
    operator, so its bits. ``lora_A`` (n, r, in) and ``lora_B`` (n, out, r) hold n = T adapters
    per loop or n = 1 shared.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, num_loops: int = 1,
                 lora_rank: int = 0, lora_alpha: float = 16.0, per_loop: bool = True, dropout: float = 0.0):
        super().__init__(in_features, out_features, bias=bias)
        self.lora_rank = 0
        self.lora_enabled = True
        if lora_rank:
            self.add_lora(lora_rank, lora_alpha, num_loops, per_loop, dropout)

    def add_lora(self, rank: int, alpha: float, num_loops: int, per_loop: bool = True, dropout: float = 0.0,
                 generator: torch.Generator | None = None) -> None:
        """Give this layer an adapter: A ~ N(0, 1/rank²) (drawn from ``generator`` when given), B = 0,
        so the layer's function is unchanged until B is trained; in this layer's dtype and device."""
        w = self.weight
        self.lora_rank, self.lora_scale, self.lora_per_loop = rank, alpha / rank, per_loop
        n = num_loops if per_loop else 1
        a = torch.empty(n, rank, self.in_features, dtype=torch.float32)
        a.normal_(0.0, 1.0 / rank, generator=generator)
        self.lora_A = nn.Parameter(a.to(device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(n, self.out_features, rank, dtype=w.dtype, device=w.device))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else None

    def forward(self, x: torch.Tensor, step: Step = 1) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.lora_rank or not self.lora_enabled:
            return out
        if self.lora_dropout is not None:
            x = self.lora_dropout(x)
        if not self.lora_per_loop:  # one adapter for every step, whatever the rows' steps
            step = 1
        if isinstance(step, int):
            a, b = self.lora_A[step - 1], self.lora_B[step - 1]
            return out + F.linear(F.linear(x, a), b) * self.lora_scale
        a, b = self.lora_A[step - 1], self.lora_B[step - 1]  # (B, r, in), (B, out, r)
        flat = x.reshape(x.shape[0], -1, x.shape[-1])
        delta = torch.bmm(torch.bmm(flat, a.transpose(1, 2)), b.transpose(1, 2))
        return out + delta.reshape(out.shape) * self.lora_scale


#: row counts at which `fusion_is_exact` compares one concatenated GEMM with the separate ones
FUSION_CHECK_ROWS = (*range(1, 33), 47, 48, 63, 64, 65, 96, 127, 128, 129, 191, 192, 255, 256, 257, 300, 383, 384,
                     511, 512)
_FUSION_EXACT: dict[tuple, bool] = {}


def fusion_is_exact(in_features: int, outs: tuple[int, ...], bias: bool, dtype: torch.dtype) -> bool:
    """Whether one GEMM over weights concatenated along the output axis gives each output the same
    bits as the separate GEMMs, on this CPU, at every row count of `FUSION_CHECK_ROWS` — measured
    once per shape, dtype and thread count (kernel choice depends on shapes, not values). It holds
    on many machines (each output is the same dot product) but not on all: on an AVX-512/AMX CPU a
    bf16 GEMM of 896 → 1152 columns over 300 rows differs from 896 → 896 + 128 + 128. Every decode
    pass asks, so the answer is looked up without entering a grad mode (that costs more than the
    lookup)."""
    key = (in_features, outs, bias, dtype, torch.get_num_threads())
    exact = _FUSION_EXACT.get(key)
    if exact is None:
        exact = _FUSION_EXACT[key] = _measure_fusion(in_features, outs, bias, dtype)
    return exact


@torch.no_grad()
def _measure_fusion(in_features: int, outs: tuple[int, ...], bias: bool, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(FUSION_CHECK_ROWS), 1, in_features, generator=gen).to(dtype)
    weights = [(torch.randn(o, in_features, generator=gen) * in_features ** -0.5).to(dtype) for o in outs]
    biases = [torch.randn(o, generator=gen).to(dtype) if bias else None for o in outs]
    fused_w, fused_b = torch.cat(weights), torch.cat(biases) if bias else None
    return all(
        all(torch.equal(a, b) for a, b in zip(F.linear(x[:n], fused_w, fused_b).split(list(outs), -1),
                                              (F.linear(x[:n], w, b) for w, b in zip(weights, biases))))
        for n in FUSION_CHECK_ROWS)


class FusedWeights:
    """The weights (and biases) of several `StepLinear` layers that read the same input, concatenated
    along the output axis for one GEMM — a copy, cached, so the checkpoint and every loader keep the
    split parameters.

    The copy is rebuilt, in place when the shapes allow, whenever a source tensor changed: its
    ``data_ptr`` (a new tensor: ``load_state_dict(assign=True)``, ``.data =``) or its version counter (any
    in-place write through the parameter: ``load_state_dict``, an optimizer step, the engine's
    ``load_weights``). The cache holds the sources' storages, so a replaced tensor's address cannot be
    reused unnoticed. A write that bypasses the parameter's version counter (into ``p.data`` or into a
    flat buffer the parameter views) is not seen: call `refresh` after one. Not copied by ``deepcopy``
    or pickling; dropped by ``Module._apply`` (``.to()``, ``.half()``, …). Its bytes are the native
    engine's ``engine_fused`` term of the memory plan (`rltt.planning.engine_memory`).
    """

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.key: tuple | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.sources: list[torch.Tensor] = []

    def __reduce__(self):
        return FusedWeights, ()

    @staticmethod
    def _key(linears) -> tuple | None:
        try:
            return tuple((t.data_ptr(), t._version) for lin in linears for t in (lin.weight, lin.bias)
                         if t is not None)
        except RuntimeError:  # inference tensors keep no version counter: never cached
            return None

    def get(self, linears) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, bias) of ``linears`` concatenated, or None where it cannot be cached."""
        key = self._key(linears)
        if key is None:
            return None
        if key != self.key:
            self.refresh(linears, key)
        return self.weight, self.bias

    def refresh(self, linears, key: tuple | None = None) -> None:
        """Copy the sources now (into the existing buffers when their shapes allow: their addresses stay).
        The copies are normal tensors even when made in inference mode (a rollout pass): a later refresh
        outside it writes them in place."""
        with torch.inference_mode(False), torch.no_grad():
            self.weight = self._cat([lin.weight for lin in linears], self.weight)
            biases = [lin.bias for lin in linears]
            self.bias = None if biases[0] is None else self._cat(biases, self.bias)
        self.sources = [t.detach() for lin in linears for t in (lin.weight, lin.bias) if t is not None]
        self.key = self._key(linears) if key is None else key

    @staticmethod
    def _cat(parts: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        if out is not None and out.shape == shape and out.dtype == parts[0].dtype and out.device == parts[0].device:
            return torch.cat(parts, out=out)
        return torch.cat(parts)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias) if t is not None)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True = attend) as the additive one SDPA makes of it on every call
    (0 / −inf in ``dtype``): made once, it gives the same results without the per-call conversion."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         is_causal: bool, scale: float) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads, dispatched like transformers' sdpa path."""
    n_rep = q.shape[1] // k.shape[1]
    kwargs = {}
    if n_rep > 1:
        if mask is None:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, **kwargs)


class Attention(nn.Module):
    def __init__(self, config: LoopConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        d, hd = config.hidden_size, config.head_dim

        def proj(name: str, fan_in: int, fan_out: int) -> StepLinear:
            rank = config.lora_rank if name in config.lora_targets else 0
            bias = config.attention_out_bias if name == "o_proj" else config.attention_bias
            return StepLinear(fan_in, fan_out, bias, config.num_loops, rank, config.lora_alpha,
                              config.lora_per_loop, config.lora_dropout)

        self.q_proj = proj("q_proj", d, self.num_heads * hd)
        self.k_proj = proj("k_proj", d, self.num_kv_heads * hd)
        self.v_proj = proj("v_proj", d, self.num_kv_heads * hd)
        self.o_proj = proj("o_proj", self.num_heads * hd, d)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.fused_qkv = FusedWeights()

    @property
    def fusable(self) -> bool:
        """Decode's one q/k/v GEMM (module docstring): only over three plain `StepLinear` without an
        adapter. A step-wise LoRA on q, k or v, or a projection some library wrapped (PEFT's
        ``lora.Linear``, whose ``weight`` is the base's alone), keeps the three projections' own forwards."""
        return all(type(p) is StepLinear and not p.lora_rank for p in (self.q_proj, self.k_proj, self.v_proj))

    def _apply(self, fn, recurse: bool = True):
        self.fused_qkv.clear()  # `.to()`, `.half()`, …: rebuilt from the converted weights on next use
        return super()._apply(fn, recurse)

    def fused_weights(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The concatenated q/k/v (weight, bias) decoding uses, or None where it keeps three projections:
        not `fusable` (an adapter on q, k or v, or a wrapped projection), or a CPU whose GEMM gives the
        concatenated outputs other bits than the three apart (`fusion_is_exact`)."""
        linears = (self.q_proj, self.k_proj, self.v_proj)
        if not self.fusable:
            return None
        weight = self.q_proj.weight
        if weight.device.type == "cpu" and not fusion_is_exact(
                weight.shape[1], tuple(lin.weight.shape[0] for lin in linears), self.q_proj.bias is not None,
                weight.dtype):
            return None
        return self.fused_qkv.get(linears)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Step = 1):
        """Project x (B, S, d) to rotary-embedded q (B, Hq, S, D) and k, v (B, Hkv, S, D)."""
        b, s, _ = x.shape
        fused = self.fused_weights() if s == 1 and not torch.is_grad_enabled() else None
        if fused is not None:  # decode: one GEMM, (B, 1, (Hq + 2·Hkv)·D) viewed as heads (B, Hq + 2·Hkv, 1, D)
            heads = F.linear(x, *fused).view(b, -1, 1, self.head_dim)
            qk, v = heads.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], 1)
            if self.q_norm is None:  # RoPE is elementwise: q and k rotated together, the same bits
                q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], 1)
                return q, k, v
            q, k = qk.split([self.num_heads, self.num_kv_heads], 1)
            return apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin), v
        if s == 1:  # one position (decode, a rollout pass): (B, 1, H, D) viewed as (B, H, 1, D) holds the
            # same elements in the same order, so the heads come without the three transposes
            q = self.q_proj(x, step).view(b, -1, 1, self.head_dim)
            k = self.k_proj(x, step).view(b, -1, 1, self.head_dim)
            v = self.v_proj(x, step).view(b, -1, 1, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
        q = self.q_proj(x, step).view(b, s, -1, self.head_dim)
        k = self.k_proj(x, step).view(b, s, -1, self.head_dim)
        v = self.v_proj(x, step).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                step: Step = 1) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin, step)
        out = attend(q, k, v, self.layer_idx)  # (B, Hq, S, D)
        # (B, S, Hq·D); at S = 1 the transpose moves no element
        out = (out if x.shape[1] == 1 else out.transpose(1, 2)).reshape(x.shape[0], x.shape[1], -1).contiguous()
        return self.o_proj(out, step)


class MLP(nn.Module):
    def __init__(self, config: LoopConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size

        def proj(name: str, fan_in: int, fan_out: int) -> StepLinear:
            rank = config.lora_rank if name in config.lora_targets else 0
            return StepLinear(fan_in, fan_out, config.mlp_bias, config.num_loops, rank, config.lora_alpha,
                              config.lora_per_loop, config.lora_dropout)

        self.gate_proj = proj("gate_proj", d, f)
        self.up_proj = proj("up_proj", d, f)
        self.down_proj = proj("down_proj", f, d)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor, step: Step = 1) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x, step)) * self.up_proj(x, step), step)


class LoopLayer(nn.Module):
    """One decoder layer with the configured norm placement.

    - ``pre``:      x += attn(ln1(x));           x += mlp(ln2(x))
    - ``post``:     x = ln1_2(x + attn(x));      x = ln2_2(x + mlp(x))
    - ``sandwich``/``ouro``: x += ln1_2(attn(ln1(x)));  x += ln2_2(mlp(ln2(x)))

    ln1 = ``input_layernorm``, ln1_2 = ``input_layernorm_2``, ln2 = ``post_attention_layernorm``,
    ln2_2 = ``post_attention_layernorm_2`` (Llama/Qwen and Ouro names).
    """

    def __init__(self, config: LoopConfig, layer_idx: int):
        super().__init__()
        self.placement = "sandwich" if config.norm_placement == "ouro" else config.norm_placement
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        d, eps = config.hidden_size, config.rms_norm_eps
        if self.placement in ("pre", "sandwich"):
            self.input_layernorm = RMSNorm(d, eps)
            self.post_attention_layernorm = RMSNorm(d, eps)
        if self.placement in ("post", "sandwich"):
            self.input_layernorm_2 = RMSNorm(d, eps)
            self.post_attention_layernorm_2 = RMSNorm(d, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                step: Step = 1) -> torch.Tensor:
        if self.placement == "pre":
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, step)
            return x + self.mlp(self.post_attention_layernorm(x), step)
        if self.placement == "post":
            x = self.input_layernorm_2(x + self.self_attn(x, cos, sin, attend, step))
            return self.post_attention_layernorm_2(x + self.mlp(x, step))
        x = x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), cos, sin, attend, step))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x), step))

