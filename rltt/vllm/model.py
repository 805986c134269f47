"""rltt's looped language model as a vLLM model class (`LoopedVllmForCausalLM`).

The arithmetic is rltt's (`rltt.model.modeling`), step for step, on vLLM's layers (parallel
linears, RMSNorm, rotary embedding, paged ``Attention``)::

    e = embed(x); carry = e
    for t in 1..T:
        z_t = inject(e, carry, t)          # none: carry;  scalar: z_1 = e, z_t = w·e + (1−w)·carry
        s_t = B(z_t)                       # the L shared layers; layer l attends through slot (t−1)·L + l
        h_t = norm_f(s_t)
        carry = h_t if carry_normed_state else s_t

KV cache: vLLM binds one KV cache to every ``Attention`` module, so the model owns T·L of them,
``model.attn_slots.{(t−1)·L + l}`` (each prefix holds exactly one integer, the slot), and every
(step, layer) pair of every token has its own K/V — the dense schedule. KV capacity is 1/T of a
plain model's.

How the exit travels. ``forward`` returns, for every token, its T normed states side by side
((N, T·d), not (N, d)); vLLM selects the rows it samples from and passes them to
``compute_logits``, which computes the gates λ_t, the exit distribution and each row's exit
t* under its exit policy, and returns the logits of step t* only — so vLLM's own sampler
draws the token from the exit step's distribution. The choice is kept on the model
(`PendingExits`: exits, gates and an fp32 copy of the returned logits, rows in vLLM's input
batch order, tagged with the step the worker extension set in ``exit_step_tag``) and consumed by
the worker extension (`rltt.vllm.worker`) once the runner's ``sample_tokens`` has returned —
after vLLM's sampler ran on the same rows, whether the runner called ``compute_logits`` before
``sample_tokens`` (Model Runner V1) or inside it (V2): it pairs each row with its request and
sampled token and appends (token, t*, log-probs, gates) to that request's record. Per-row exit settings come
from ``row_exits`` (installed by the worker extension; it reads each request's
``extra_args``); without it (plain ``vllm serve``) every row uses the config's exit policy
and ``sample`` draws from torch's global generator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsLoRA
from vllm.sequence import IntermediateTensors

from rltt.model.configuration import LoopConfig
from rltt.vllm.row_exits import RowExits, choose_exits, parse_policy

# checkpoint name (rltt's, = Qwen/Llama's) -> (vLLM's merged parameter, shard id)
STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


def slot_index(step: int, layer: int, num_layers: int) -> int:
    """KV slot of (1-based step, 0-based layer): (t−1)·L + l, as in `rltt.model.loop_cache.LoopCache`."""
    return (step - 1) * num_layers + layer


class LoopAttention(nn.Module):
    """q/k/v projections (+ optional per-head q/k RMSNorm), rotary, and the output projection;
    the attention itself is the ``Attention`` slot the caller passes in."""

    def __init__(self, config: LoopConfig, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_out_bias, prefix=f"{prefix}.o_proj")
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings, is_neox_style=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)})

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: Attention) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            n = q.shape[0]
            q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim)).reshape(n, self.q_size)
            k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).reshape(n, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        out, _ = self.o_proj(attn(q, k, v))
        return out


class LoopMLP(nn.Module):
    def __init__(self, config: LoopConfig, prefix: str):
        super().__init__()
        f = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [f, f], bias=config.mlp_bias,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(f, config.hidden_size, bias=config.mlp_bias, prefix=f"{prefix}.down_proj")
        self.silu = SiluAndMul() if config.hidden_act == "silu" else None
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        if self.silu is not None:
            hidden = self.silu(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = self.act(gate) * up
        out, _ = self.down_proj(hidden)
        return out


class LoopLayer(nn.Module):
    """One shared decoder layer with rltt's norm placements (`rltt.model.layers.LoopLayer`):

    - ``pre``:      x += attn(ln1(x));           x += mlp(ln2(x))
    - ``post``:     x = ln1_2(x + attn(x));      x = ln2_2(x + mlp(x))
    - ``sandwich``/``ouro``: x += ln1_2(attn(ln1(x)));  x += ln2_2(mlp(ln2(x)))
    """

    def __init__(self, config: LoopConfig, prefix: str):
        super().__init__()
        self.placement = "sandwich" if config.norm_placement == "ouro" else config.norm_placement
        self.self_attn = LoopAttention(config, f"{prefix}.self_attn")
        self.mlp = LoopMLP(config, f"{prefix}.mlp")
        d, eps = config.hidden_size, config.rms_norm_eps
        if self.placement in ("pre", "sandwich"):
            self.input_layernorm = RMSNorm(d, eps=eps)
            self.post_attention_layernorm = RMSNorm(d, eps=eps)
        if self.placement in ("post", "sandwich"):
            self.input_layernorm_2 = RMSNorm(d, eps=eps)
            self.post_attention_layernorm_2 = RMSNorm(d, eps=eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: Attention) -> torch.Tensor:
        if self.placement == "pre":
            x = x + self.self_attn(positions, self.input_layernorm(x), attn)
            return x + self.mlp(self.post_attention_layernorm(x))
        if self.placement == "post":
            x = self.input_layernorm_2(x + self.self_attn(positions, x, attn))
            return self.post_attention_layernorm_2(x + self.mlp(x))
        x = x + self.input_layernorm_2(self.self_attn(positions, self.input_layernorm(x), attn))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


# vLLM compiles the forward (torch.compile, then CUDA graphs) unless enforce_eager: the token
# dimension of every input is dynamic; compute_logits (gate, exit policy, records) stays eager.
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class LoopedVllmModel(nn.Module):
    """Embedding, shared block, per-step final norm, exit gate, injection weight, KV slots.

    Compiled by vLLM (`support_torch_compile`) unless ``enforce_eager``: ``forward`` takes only
    tensors whose first dimension is the token count (and ``None``, always ``None``), keeps its
    loop structure in Python ints (unrolled at trace time) and reads parameters in place, so a
    weight reload in place (`rltt.vllm.worker`) is seen by the compiled graph and its CUDA graphs."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: LoopConfig = vllm_config.model_config.hf_config
        self.config = config
        tp = get_tensor_model_parallel_world_size()
        T, L = config.num_loops, config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(LoopLayer(config, f"{prefix}.layers.{i}") for i in range(L))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if config.final_norm == "rmsnorm" else None
        # the gate is one row: a plain (replicated) linear, in the model dtype as in rltt
        self.exit_gate = nn.Linear(config.hidden_size, 1, bias=True)
        self.injection_logit = (nn.Parameter(torch.tensor(float(config.injection_init)))
                                if config.injection == "scalar" else None)
        heads, kv_heads = config.num_attention_heads // tp, max(1, config.num_key_value_heads // tp)
        self.attn_slots = nn.ModuleList(
            Attention(heads, config.head_dim, config.head_dim**-0.5, num_kv_heads=kv_heads,
                      cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn_slots.{slot}")
            for slot in range(T * L)
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def inject(self, embeds: torch.Tensor, carry: torch.Tensor, step: int) -> torch.Tensor:
        if self.injection_logit is None:
            return carry
        if step == 1:
            return embeds
        w = torch.sigmoid(self.injection_logit).to(carry.dtype)
        return w * embeds + (1 - w) * carry

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """(N, T·d): the normed states h_1..h_T of every token, side by side."""
        cfg = self.config
        e = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        carry, states = e, []
        for t in range(1, cfg.num_loops + 1):
            z = self.inject(e, carry, t)
            for layer_idx, layer in enumerate(self.layers):
                z = layer(positions, z, self.attn_slots[slot_index(t, layer_idx, cfg.num_hidden_layers)])
            h = z if self.norm is None else self.norm(z)
            states.append(h)
            carry = h if cfg.carry_normed_state else z
        return torch.cat(states, dim=-1)

    def gates(self, step_hidden: torch.Tensor) -> torch.Tensor:
        """λ (T, n) fp32 of step_hidden (n, T, d): σ(w_gᵀ h_t + b_g), as `LoopedModel.gate`."""
        return torch.sigmoid(self.exit_gate(step_hidden).squeeze(-1).float()).transpose(0, 1)


@dataclass
class PendingExits:
    """What the last ``compute_logits`` chose, rows in vLLM's input-batch order: ``exits`` (n,)
    int64, ``gates`` (T, n) fp32, ``logits`` (n, V) fp32 copy of the returned logits (vLLM's
    sampler may modify its input in place), ``request_ids`` the rows' requests (from
    ``row_exits``; None when unknown, e.g. a warm-up batch), ``step`` the worker extension's step
    counter when they were chosen (``exit_step_tag``)."""

    exits: torch.Tensor
    gates: torch.Tensor
    logits: torch.Tensor
    request_ids: list[str] | None
    step: int = 0


RowExitsFn = Callable[[int], "tuple[list[str], RowExits] | None"]


class LoopedVllmForCausalLM(nn.Module, SupportsLoRA):
    """vLLM model class of rltt's ``LoopedForCausalLM`` checkpoints (architecture ``LoopedForCausalLM``)."""

    #: vLLM's LoRA (``enable_lora``): a PEFT adapter's q/k/v and gate/up projections land on the merged layers
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: LoopConfig = vllm_config.model_config.hf_config
        if config.lora_rank:
            raise ValueError("rltt vLLM model: step-wise LoRA (lora_rank > 0) is not supported in vLLM; "
                             "merge it or use rollout.engine=native")
        self.config = config
        self.model = LoopedVllmModel(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      prefix=f"{prefix}.lm_head" if prefix else "lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        # set by the worker extension (rltt.vllm.worker); see the module docstring
        self.row_exits: RowExitsFn | None = None
        self.record_exits = False
        self.pending: PendingExits | None = None
        self.exit_step_tag = 0

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        cfg = self.config
        n, T, d = hidden_states.shape[0], cfg.num_loops, cfg.hidden_size
        step_hidden = hidden_states.view(n, T, d)
        gates = self.model.gates(step_hidden)
        context = self.row_exits(n) if self.row_exits is not None else None
        if context is None:
            request_ids, policy = None, parse_policy(cfg.exit_policy, T)
            uniforms = torch.rand(n, dtype=torch.float64) if policy.kind == "sample" else None
            rows = RowExits.uniform_policy(policy, n, uniforms)
        else:
            request_ids, rows = context
        exits = choose_exits(gates, rows)
        chosen = step_hidden[torch.arange(n, device=step_hidden.device), exits.to(step_hidden.device) - 1]
        logits = self.logits_processor(self.lm_head, chosen)
        if self.record_exits and logits is not None:
            self.pending = PendingExits(exits.cpu(), gates.cpu(), logits.float().clone(), request_ids,
                                        self.exit_step_tag)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load rltt checkpoint names (``LoopedForCausalLM.state_dict()``) into vLLM's layout."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or "lora_" in name:
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            for old, new, shard in STACKED:
                if old in name:
                    target = name.replace(old, new)
                    param = params[target]
                    param.weight_loader(param, tensor, shard)
                    break
            else:
                target = name
                if target not in params:
                    raise KeyError(f"rltt vLLM model: checkpoint tensor {name!r} has no parameter")
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        return loaded
