"""The looped language model: one forward you can follow.

    e = embed(x); carry = e
    for t in 1..T:                         # LoopedModel.step, shared with the rollout executor
        z_t = inject(e, carry, t)          # z_1 = e; then none: z_t = carry;  scalar: z_t = w·e + (1−w)·carry
        s_t = B(z_t)                       # the L shared layers, KV slot (t−1)·L + l
        h_t = norm_f(s_t)                  # per-step state: logits ℓ_t = lm_head(h_t), gate λ_t = σ(g(h_t))
        carry = h_t if carry_normed_state else s_t
    p = survival(λ)                        # exit distribution over steps

The exit policy picks, for every position, the step t* whose logits the forward returns.

Activation checkpointing (``model.gradient_checkpointing_enable()``; the learner's
``learner.activation_checkpointing``) wraps every (loop step, layer) call of B in a non-reentrant
`torch.utils.checkpoint`: autograd keeps each call's input z (T·L per position) instead of its
internals, and the backward recomputes one layer call at a time — every layer once more, the
least any recompute can do, at the memory of one layer. It applies to the training forwards
(`LoopedModel.steps`: the padded and the packed one) with gradients on and no KV cache written;
the rollout executor's passes (`LoopedModel.step` called directly) never checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput, logging

from rltt.model.loop_cache import LoopCache, attention_mask_for, ensure_slots
from rltt.model.configuration import LoopConfig
from rltt.model.exits import ExitPolicy, exit_distribution
from rltt.model.layers import Attend, LoopLayer, RMSNorm, RotaryEmbedding, Step, StepLinear, sdpa
from rltt.model.packing import PackedAttend, PackedLayout

logger = logging.get_logger(__name__)

@dataclass
class LoopOutput(ModelOutput):
    """What the looped forward returns. Step-indexed tensors have T first; steps are 1-based."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # (B, S, V) logits of the exit step t*
    past_key_values: Cache | None = None
    exit_steps: torch.Tensor | None = None  # (B, S) t* chosen by the exit policy
    gate_probs: torch.Tensor | None = None  # (T, B, S) λ_t
    exit_probs: torch.Tensor | None = None  # (T, B, S) p_t
    step_hidden: torch.Tensor | None = None  # (T, B, S, d) normed per-step states h_t (opt-in)
    step_logits: torch.Tensor | None = None  # (T, B, S, V) per-step logits (opt-in: T× memory)
    token_logprobs: torch.Tensor | None = None  # (T, N) per-loop log-probs of the scored tokens
    token_entropy: torch.Tensor | None = None  # (T, N) per-loop entropies at the scored tokens
    token_exit_probs: torch.Tensor | None = None  # (T, N) exit distribution that produced each scored token


class CacheAttend:
    """Default attention of the forward: write (k, v) to KV slot (t−1)·L + l, then SDPA."""

    def __init__(self, cache: Cache | None, step: int, num_layers: int, mask, is_causal: bool, scale: float):
        self.cache, self.step, self.num_layers = cache, step, num_layers
        self.mask, self.is_causal, self.scale = mask, is_causal, scale

    def __call__(self, q, k, v, layer_idx):
        if self.cache is not None:
            k, v = self.cache.update(k, v, LoopCache.slot(self.step, layer_idx, self.num_layers))
        return sdpa(q, k, v, self.mask, self.is_causal, self.scale)


class LMHead(nn.Linear):
    """The LM head. Called with ``targets`` it returns per-loop log-probs and entropies of the
    targets through `rltt.kernels` (no (T, N, V) logits), inside the head's own forward so
    that ZeRO-3 gathers its weight as for any module call."""

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None, temperature: float = 1.0,
                mask: torch.Tensor | None = None, kept_floor: torch.Tensor | None = None,
                kept_dtype: torch.dtype | None = None):
        if targets is None:
            return super().forward(hidden)
        from rltt.kernels import per_loop_logprobs

        # a plain tuple, so that ZeRO-3's backward hooks see the output tensors and re-gather the weight;
        # fp32 states with a 16-bit weight (an fp32 readout) are upcast inside the kernels
        out = per_loop_logprobs(hidden, self.weight, targets, temperature=temperature, mask=mask,
                                kept_floor=kept_floor, kept_dtype=kept_dtype)
        return out.logprobs, out.entropy


class LoopedPreTrainedModel(PreTrainedModel):
    config_class = LoopConfig
    config: LoopConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LoopLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_attention_backend = False

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, StepLinear) and module.lora_rank:
            init.normal_(module.lora_A, std=1.0 / module.lora_rank)
            init.zeros_(module.lora_B)
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, LoopedModel) and module.injection_logit is not None:
            init.constant_(module.injection_logit, self.config.injection_init)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func: Callable = checkpoint,
                                    every_n_layers: int = 1):
        """What transformers' ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...,
        every_n_layers=n)`` / ``gradient_checkpointing_disable()`` call: the `LoopedModel` inside
        checkpoints layer l of every loop step when l % n == 0, with ``gradient_checkpointing_func``
        (``checkpoint(..., use_reentrant=False)`` by default)."""
        for module in self.modules():
            if isinstance(module, LoopedModel):
                module.gradient_checkpointing = enable
                module._gradient_checkpointing_func = gradient_checkpointing_func
                module.checkpoint_every = every_n_layers


class LoopedModel(LoopedPreTrainedModel):
    """Embedding, shared block, per-step final norm, exit gate (no LM head)."""

    def __init__(self, config: LoopConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(LoopLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.final_norm == "rmsnorm" else None
        self.exit_gate = nn.Linear(config.hidden_size, 1, bias=True)
        self.injection_logit = (
            nn.Parameter(torch.tensor(float(config.injection_init))) if config.injection == "scalar" else None
        )
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        # activation checkpointing (module docstring), set by `_set_gradient_checkpointing`
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
        self.checkpoint_every = 1
        self.post_init()

    # -- one loop step and its pieces ----------------------------------------------------------
    def inject(self, embeds: torch.Tensor, carry: torch.Tensor, step: Step) -> torch.Tensor:
        """z_t from the embeddings e and the carried state: z_1 = e; for t > 1, z_t = carry
        (``none``) or w·e + (1 − w)·carry (``scalar``, w = σ(a)). ``step`` is an int or one per row."""
        if isinstance(step, int) and step == 1:
            return embeds
        if self.injection_logit is None:
            mixed = carry
        else:
            w = torch.sigmoid(self.injection_logit).to(carry.dtype)
            mixed = w * embeds + (1 - w) * carry
        if isinstance(step, int):
            return mixed
        first = (step == 1).view(-1, *([1] * (carry.dim() - 1)))
        return torch.where(first, embeds, mixed)

    def block(self, z: torch.Tensor, cos, sin, attend: Attend, step: Step, checkpointed: bool = False) -> torch.Tensor:
        """s_t = B(z_t): the L shared layers; ``checkpointed``: each layer call under the
        checkpoint function (`checkpointing`), its internals recomputed in the backward."""
        for i, layer in enumerate(self.layers):
            if checkpointed and i % self.checkpoint_every == 0:
                z = self._gradient_checkpointing_func(layer, z, cos, sin, attend, step)
            else:
                z = layer(z, cos, sin, attend, step)
        return z

    def final_norm(self, s: torch.Tensor) -> torch.Tensor:
        return s if self.norm is None else self.norm(s)

    def final_norm_fp32(self, s: torch.Tensor) -> torch.Tensor:
        """The final norm of ``s`` computed and returned in fp32 (never rounded to a 16-bit dtype):
        the LM head's input under an fp32 readout (`LearnerConfig.lm_head_dtype`)."""
        x = s.float()
        if self.norm is None:
            return x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
        return self.norm.weight.float() * x

    def fused_bytes(self) -> int:
        """Bytes of the concatenated q/k/v weights the layers hold for decoding now (`FusedWeights`;
        ``ModelShape.fused_parameters`` plans them)."""
        return sum(layer.self_attn.fused_qkv.nbytes() for layer in self.layers)

    def refresh_fused_weights(self) -> None:
        """Copy the q/k/v weights into the decode path's concatenations now, in place: for a caller that
        replays captured passes (a CUDA graph reads the buffers' addresses and runs no Python check)
        after the weights changed, or after a write that bypassed the parameters' version counters."""
        for layer in self.layers:
            attn = layer.self_attn
            if attn.fusable:
                attn.fused_qkv.refresh((attn.q_proj, attn.k_proj, attn.v_proj))

    def gate(self, h: torch.Tensor) -> torch.Tensor:
        """λ_t = σ(w_gᵀ h_t + b_g) in fp32, shape h.shape[:-1]."""
        return torch.sigmoid(self.exit_gate(h).squeeze(-1).float())

    def step(self, embeds: torch.Tensor, carry: torch.Tensor, step: Step, cos: torch.Tensor, sin: torch.Tensor,
             attend: Attend, checkpointed: bool = False,
             fp32_readout: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One loop step: inject → block → norm → carry. Returns ``(h_t, carry for step t + 1)``.

        The one place the loop step is written: the forward and the packed forward (through
        `steps`) and the rollout executor (`rltt.rollout.executor`: a pass is one step of many
        (row, position) items, ``step`` then one per item) all call it. The exit gate
        λ_t = ``gate(h_t)`` reads h_t like the LM head does and feeds nothing back, so callers
        apply it: the forward once over all T steps, the executor once per pass.
        ``checkpointed``: activation checkpointing of the block's layer calls (the forwards pass
        `checkpointing`; the executor never does — its attention writes a cache).
        ``fp32_readout``: the first element is ``(h_t, final_norm_fp32(s_t))``, the state as computed
        and the LM head's fp32 input."""
        s = self.block(self.inject(embeds, carry, step), cos, sin, attend, step, checkpointed)
        h = self.final_norm(s)
        carry = h if self.config.carry_normed_state else s
        return ((h, self.final_norm_fp32(s)) if fp32_readout else h), carry

    def checkpointing(self) -> bool:
        """Whether a forward now checkpoints its layer calls: switched on (`gradient_checkpointing`),
        in training mode and with gradients enabled — never in eval, no-grad or rollout passes."""
        return self.gradient_checkpointing and self.training and torch.is_grad_enabled()

    def steps(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              attend_at: Callable[[int], Attend], checkpointed: bool = False,
              fp32_readout: bool = False) -> Iterator[torch.Tensor]:
        """h_1, …, h_T over every position; ``attend_at(t)`` is step t's attention. A generator: a
        caller's per-step readout (the packed forward's ``h[0]``) is taken as each step ends.
        ``checkpointed``: activation checkpointing (the attention must not write a cache, which
        the recompute would write again). ``fp32_readout``: yield ``(h_t, final_norm_fp32(s_t))``
        — the step's state as computed (gate, carry) and the LM head's fp32 input."""
        carry = embeds
        for t in range(1, self.config.num_loops + 1):
            h, carry = self.step(embeds, carry, t, cos, sin, attend_at(t), checkpointed, fp32_readout)
            yield h

    # -- the forward -------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, fp32_readout: bool = False):
        """Returns (step_hidden (T, B, S, d), gate_probs (T, B, S)), writing to ``past_key_values``.
        ``fp32_readout``: step_hidden is the fp32 final norm (`final_norm_fp32`), the gates as without."""
        cfg = self.config
        e = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        bsz, seq = e.shape[:2]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -seq:]
            else:
                position_ids = torch.arange(past, past + seq, device=e.device).expand(bsz, seq)
        cos, sin = self.rotary_emb(position_ids, e.dtype)
        mask, is_causal = attention_mask_for(attention_mask, seq, past, e.device)
        scale = cfg.head_dim**-0.5

        def attend_at(t: int) -> CacheAttend:
            return CacheAttend(past_key_values, t, cfg.num_hidden_layers, mask, is_causal, scale)

        # a KV cache being written is never checkpointed (`LoopedForCausalLM` turns it off instead)
        checkpointed = self.checkpointing() and past_key_values is None
        if fp32_readout:
            states, readout = zip(*self.steps(e, cos, sin, attend_at, checkpointed, fp32_readout=True))
            return torch.stack(readout), self.gate(torch.stack(states))
        step_hidden = torch.stack(list(self.steps(e, cos, sin, attend_at, checkpointed)))
        return step_hidden, self.gate(step_hidden)

    def packed(self, layout: PackedLayout, fp32_readout: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward over a packed sequence (`rltt.model.packing`): returns step_hidden
        (T, N, d) and gate_probs (T, N) of its N tokens (``fp32_readout`` as in `forward`)."""
        e = self.embed_tokens(layout.input_ids)[None]  # (1, N, d)
        cos, sin = self.rotary_emb(layout.positions[None], e.dtype)
        attend = PackedAttend(layout, self.config.head_dim**-0.5, e.dtype)
        if fp32_readout:
            pairs = [(h[0], r[0]) for h, r in self.steps(e, cos, sin, lambda t: attend, self.checkpointing(),
                                                           fp32_readout=True)]
            return torch.stack([r for _, r in pairs]), self.gate(torch.stack([h for h, _ in pairs]))
        step_hidden = torch.stack([h[0] for h in self.steps(e, cos, sin, lambda t: attend, self.checkpointing())])
        return step_hidden, self.gate(step_hidden)


class LoopedForCausalLM(LoopedPreTrainedModel, GenerationMixin):
    """A looped LM: `LoopedModel` + LM head, with per-step logits, exits and `generate()`."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LoopConfig):
        super().__init__(config)
        self.model = LoopedModel(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def load_mapped_weights(self, state: dict[str, torch.Tensor], source: str,
                            allowed_missing: tuple[str, ...] = ()) -> None:
        """Load a state dict whose names were mapped to rltt's; anything missing (besides LoRA,
        a tied head and ``allowed_missing``) or left over is a one-line error naming ``source``."""
        from rltt.errors import RlttError

        if self.config.tie_word_embeddings:
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if "lora_" not in k and k not in allowed_missing
                   and not (self.config.tie_word_embeddings and k == "lm_head.weight")]
        unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
        if missing or unexpected:
            raise RlttError(f"{source}: weight names do not map (missing {missing[:3]}, unexpected {unexpected[:3]})")
        if self.config.tie_word_embeddings:
            self.tie_weights()

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def exit_policy(self, spec=None) -> ExitPolicy:
        """``spec`` (an `ExitPolicy` or its text) checked against T, else the config's own policy,
        parsed once per ``(config.exit_policy, num_loops)`` and kept (a changed config re-parses)."""
        if isinstance(spec, ExitPolicy):
            return spec.check(self.config.num_loops)
        if spec is not None:
            return ExitPolicy.parse(spec, self.config.num_loops)
        key = (self.config.exit_policy, self.config.num_loops)
        cached = self.__dict__.get("_config_exit_policy")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_config_exit_policy"] = (key, ExitPolicy.parse(*key))
        return cached[1]

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        exit_policy: str | ExitPolicy | None = None,
        output_step_logits: bool = False,
        output_step_hidden: bool = False,
        generator: torch.Generator | None = None,
        score_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
        pack: bool = False,
        kept_floor: torch.Tensor | None = None,
        head_dtype: torch.dtype | None = None,
        kept_dtype: torch.dtype | None = None,
        **kwargs,
    ) -> LoopOutput:
        if score_mask is not None:
            return self.score(input_ids, attention_mask, score_mask, temperature, pack, kept_floor, head_dtype,
                              kept_dtype)
        cfg = self.config
        use_cache = cfg.use_cache if use_cache is None else use_cache
        if use_cache and self.model.checkpointing():
            logger.warning_once("use_cache=True is incompatible with activation checkpointing: "
                                "setting use_cache=False")
            use_cache = False
        if use_cache:
            past_key_values = ensure_slots(past_key_values if past_key_values is not None else LoopCache(),
                                           cfg.num_loops * cfg.num_hidden_layers)
        else:
            past_key_values = None
        policy = self.exit_policy(exit_policy)

        step_hidden, gate_probs = self.model(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds)
        exit_probs = exit_distribution(gate_probs)
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        kept_hidden = step_hidden[:, :, keep]
        exit_steps = policy.choose(exit_probs[:, :, keep], generator)
        if policy.kind == "final":
            chosen = kept_hidden[-1]
        else:
            index = (exit_steps - 1)[None, :, :, None].expand(1, *kept_hidden.shape[1:])
            chosen = kept_hidden.gather(0, index)[0]
        logits = self.lm_head(chosen)

        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return LoopOutput(
            loss=loss,
            logits=logits,
            past_key_values=past_key_values,
            exit_steps=exit_steps,
            gate_probs=gate_probs,
            exit_probs=exit_probs,
            step_hidden=step_hidden if output_step_hidden else None,
            step_logits=self.lm_head(kept_hidden) if output_step_logits else None,
        )

    def score(self, input_ids, attention_mask, score_mask: torch.Tensor, temperature: float = 1.0,
              pack: bool = False, kept_floor: torch.Tensor | None = None,
              head_dtype: torch.dtype | None = None, kept_dtype: torch.dtype | None = None) -> LoopOutput:
        """Score mode (``forward(..., score_mask=M)``): per-loop log-probs ``log P^(t)(x_j)`` and
        entropies of the tokens at positions where ``M`` (B, S) is true, for all T loops, through
        `rltt.kernels` (no (T, N, V) logits), plus the exit distribution of the state that produced
        each of them (position j − 1). Going through ``forward`` keeps wrappers (DeepSpeed) in charge.

        ``pack=True`` (right-padded batches) computes each distinct prefix — the positions before
        a row's first scored token, e.g. the prompt shared by a group's G completions — once, and
        no padding (`rltt.model.packing`); the result is the same function, and ``gate_probs``
        (B, S-shaped) is then not returned.

        ``kept_floor`` (B, S) integer: the kept-set floor token of each scored token (top-k/top-p
        sampling; -1 = the whole vocabulary): its log-probs are renormalised over the tokens each
        loop scores at least as high as that token (`rltt.kernels.per_loop_logprobs`), with the
        logits rounded to ``kept_dtype`` (the rollout's LM-head dtype) for that comparison.
        ``head_dtype``: torch.float32 on a 16-bit model runs the final norm of the LM head's input
        and the head in fp32 (`LoopedModel.final_norm_fp32`; the gates, the carried state and the
        head weight stay as they are); None or the model's dtype: as computed."""
        mask = score_mask.bool()
        if mask[:, 0].any():
            raise ValueError("score_mask: position 0 cannot be scored (it has no context)")
        predicts = mask[:, 1:]  # the state at position i produced the token at i + 1
        targets = input_ids[:, 1:][predicts]
        floors = None if kept_floor is None else kept_floor[:, 1:][predicts]
        if head_dtype not in (None, torch.float32):
            raise ValueError(f"head_dtype: None or torch.float32, got {head_dtype}")
        fp32_readout = head_dtype == torch.float32 and self.lm_head.weight.dtype != torch.float32
        layout = PackedLayout.build(input_ids, attention_mask, mask) if pack else None
        if layout is not None:
            step_hidden, gate_probs = self.model.packed(layout, fp32_readout)  # (T, N, d), (T, N)
            source = layout.packed_of[:, :-1][predicts]
            hidden, gates, gate_probs = step_hidden[:, source], gate_probs[:, source], None
        else:
            step_hidden, gate_probs = self.model(input_ids, attention_mask, fp32_readout=fp32_readout)
            hidden, gates = step_hidden[:, :, :-1][:, predicts], gate_probs[:, :, :-1][:, predicts]
        logprobs, entropy = self.lm_head(hidden, targets=targets, temperature=temperature, kept_floor=floors,
                                         kept_dtype=kept_dtype)
        return LoopOutput(gate_probs=gate_probs, token_logprobs=logprobs, token_entropy=entropy,
                          token_exit_probs=exit_distribution(gates))
