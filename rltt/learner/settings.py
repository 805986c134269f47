"""Typed settings of the RL learner: the algorithm (the ``algorithm`` recipe section) and the
optimisation backend (``learner``). Choices and ranges are declared on the fields and checked by
`rltt.config`, at recipe load and when built directly in code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rltt.config import (NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Range, check_fields,
                         recipe_error)
from rltt.learner.backends import BACKENDS
from rltt.learner.rounding import ROUNDINGS
from rltt.objectives.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGE_SCALES, COMPUTE_PRICES, SCALES_OF
from rltt.objectives.corrections import CORRECTIONS
from rltt.objectives.policy_losses import POLICY_LOSSES
from rltt.objectives.logprob import Omega, PolicyLogprobKind
from rltt.objectives.rl import Aggregation, AdvantageScale, KlEstimator, PolicyLossKind
from rltt.sections import Dtype

Beta = Annotated[float, Range(ge=0, lt=1)]

#: ``learner.lm_head_dtype``: the dtype the learner's LM head — the final norm of its input, the
#: head and the per-loop log-prob kernel — runs in. ``model``: the model's own (None); ``fp32``:
#: fp32 from a 16-bit model (the states and the head weight upcast inside the kernel call; on an
#: fp32 model nothing changes)
LM_HEAD_DTYPES = {"model": None, "fp32": "float32"}


@dataclass
class AlgorithmConfig:
    """RLTT / GRPO objective (docs/design.md §5.5–5.6); the choices are the keys of the tables in
    `rltt.objectives`.

    ``policy_logprob``: exit | final | mixture | rltt (ω = ``omega``: exit_pdf | uniform |
    progressive | learned). ``loss``: ppo_clip (``eps_low``/``eps_high``, ``ppo_epochs`` = μ),
    reinforce, gspo (the sequence-ratio clip ``gspo_eps_low``/``gspo_eps_high``) or cispo (the
    importance weight capped at 1 + ``cispo_eps_high``, no lower bound).
    ``advantage``: grpo | rloo | reinforce_pp, normalised by ``advantage_scale`` (group | batch |
    none; reinforce_pp whitens over the batch itself and takes ``batch`` only).
    ``hybrid_logprob``: use logp_dense(θ) + sg(logp_rollout − logp_dense(θ_rollout)) for the
    ``exit`` log-prob. ``kl_in``: loss | reward; ``kl_on``: final (loop T, RLTT) or
    policy (the chosen log-prob).
    ``correction``: the rollout correction for a sampler/learner mismatch — none | token_tis |
    seq_tis (truncated at ``correction_cap``) | token_mask | seq_mask | geo_mask (tokens or
    sequences whose ratio leaves [``correction_lo``, ``correction_hi``] are masked) | decoupled
    (AReaL's decoupled PPO: the loss's clip is against the proximal policy — the learner's weights at
    the step's start — and each token is weighted by π_prox/π_behav, masked above ``decoupled_cap``).
    ``tis_cap``: the older name of token TIS — set, it selects ``correction: token_tis`` with
    ``correction_cap = tis_cap`` (None = off).
    ``track_kl``: keep the frozen reference (one extra no-grad forward) to log ``kl/ref``
    even with ``kl_coef = 0`` — the first sign that the policy is (not) moving.
    ``dynamic_sampling``: drop groups whose rewards are all equal and refill the batch.
    ``compute_cost``: λ ≥ 0, a price on compute — λ · (mean recorded exit step of a completion's
    sampled tokens) / T is subtracted from its reward before the advantages (docs/design.md §5.11).
    ``compute_price``: where the price enters — ``reward`` (subtracted from the reward, then the
    advantage estimator and its normaliser; under ``advantage_scale: group`` a group whose task
    rewards all tie gets its whole advantage from the price, scaled to unit size) or ``advantage``
    (the advantages come from the task reward alone, then each row's price, centred in its group
    and unscaled, is subtracted: the price weighs λ against a unit of task advantage).
    ``exit_action``: the exit step is part of the action — the policy log-prob (loss, ratio, KL on
    the policy log-prob, mismatch) is the joint log π(t*, y) = log p_{t*} + log P^(t*)(y), so the
    gate gets a gradient (docs/design.md §5.12); needs the ``exit`` log-prob and sampled exits.
    """

    policy_logprob: PolicyLogprobKind = "exit"
    omega: Omega = "exit_pdf"
    omega_alpha: float = 1.0
    omega_detach: bool = True
    loss: PolicyLossKind = "ppo_clip"
    eps_low: Annotated[float, Range(ge=0, lt=1)] = 0.2
    eps_high: NonNegativeFloat = 0.28
    gspo_eps_low: Annotated[float, Range(ge=0, lt=1)] = 3e-4  # GSPO's sequence-ratio clip range
    gspo_eps_high: NonNegativeFloat = 4e-4
    cispo_eps_high: NonNegativeFloat = 3.0  # CISPO's importance weight is capped at 1 + this
    ppo_epochs: PositiveInt = 1
    aggregation: Aggregation = "token_mean"
    advantage: Literal[tuple(ADVANTAGE_ESTIMATORS)] = "grpo"  # type: ignore[valid-type]  # the estimator table's names
    advantage_scale: AdvantageScale = "group"
    kl_coef: NonNegativeFloat = 0.0
    kl_estimator: KlEstimator = "k3"
    kl_in: Literal["loss", "reward"] = "loss"
    kl_on: Literal["final", "policy"] = "final"
    correction: Literal[tuple(CORRECTIONS)] = "none"  # type: ignore[valid-type]  # the correction table's names
    correction_cap: PositiveFloat = 2.0
    correction_lo: NonNegativeFloat = 0.5
    correction_hi: PositiveFloat = 5.0
    decoupled_cap: PositiveFloat = 5.0  # correction decoupled: tokens with π_prox/π_behav above it are masked
    tis_cap: PositiveFloat | None = None
    hybrid_logprob: bool = True
    track_kl: bool = True  # keep a frozen reference to log kl/ref even when kl_coef = 0
    dynamic_sampling: bool = False
    max_refills: NonNegativeInt = 4
    compute_cost: NonNegativeFloat = 0.0  # λ: the reward given up by a completion whose every token runs all T loops
    # where the price enters (see above): the names of the placement table
    compute_price: Literal[tuple(COMPUTE_PRICES)] = "reward"  # type: ignore[valid-type]
    exit_action: bool = False  # the sampled exit step is part of the action: log p_{t*} joins the policy log-prob

    def __post_init__(self) -> None:
        check_fields(self, "algorithm")
        scales = SCALES_OF.get(self.advantage, ADVANTAGE_SCALES)
        if self.advantage_scale not in scales:
            raise recipe_error("algorithm.advantage_scale",
                               f"advantage {self.advantage!r} takes {' | '.join(scales)}, got {self.advantage_scale!r}")
        if self.exit_action and self.policy_logprob != "exit":
            raise recipe_error("algorithm.exit_action", f"needs algorithm.policy_logprob: exit (the joint log-prob "
                                                        f"of the sampled exit and token), got {self.policy_logprob!r}")
        if self.correction_lo >= self.correction_hi:
            raise recipe_error("algorithm.correction_lo",
                               f"must be below correction_hi ({self.correction_hi:g}), got {self.correction_lo:g}")
        if self.correction == "decoupled" and not POLICY_LOSSES[self.loss].needs_old:
            raise recipe_error("algorithm.correction", f"decoupled clips the ratio against the proximal policy; "
                                                       f"algorithm.loss {self.loss!r} has no ratio (use ppo_clip)")
        if self.tis_cap is not None:  # the alias of token TIS
            if self.correction not in ("none", "token_tis"):
                raise recipe_error("algorithm.tis_cap", f"is token TIS; it cannot be combined with correction "
                                                        f"{self.correction!r} (use correction_cap)")
            self.correction, self.correction_cap = "token_tis", self.tis_cap


#: ``learner.lora.target_modules``' default: every attention and MLP projection of the shared block
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSection:
    """``learner.lora``: train LoRA adapters instead of the whole model (`rltt.model.adapters`).

    ``rank`` r and ``alpha`` (the update is alpha/r · B A), ``dropout`` on the adapters' input while
    training, ``target_modules`` (default: every attention and MLP projection), ``per_loop``: one
    adapter per loop step (true) or one shared by every step (false). Only the adapters get
    gradients and optimizer state; the base stays frozen in the model's dtype, and the KL reference
    is the base with the adapters off (no second copy)."""

    rank: PositiveInt = 16
    alpha: PositiveFloat = 32.0
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    per_loop: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "learner.lora")
        bad = [t for t in self.target_modules if t not in LORA_DEFAULT_TARGETS]
        if bad:
            raise recipe_error("learner.lora.target_modules", f"unknown module {bad[0]!r}; choose from "
                                                              f"{', '.join(LORA_DEFAULT_TARGETS)}")
        if not self.target_modules:
            raise recipe_error("learner.lora.target_modules", "must name at least one projection")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise recipe_error("learner.lora.target_modules", f"names a module twice: {self.target_modules}")

    def spec(self):
        """The `rltt.model.adapters.AdapterSpec` of this section."""
        from rltt.model.adapters import AdapterSpec

        return AdapterSpec(self.rank, float(self.alpha), tuple(self.target_modules), self.per_loop,
                           float(self.dropout))


@dataclass
class LearnerConfig:
    """Optimisation: ``backend`` torch (plain PyTorch AdamW) or deepspeed (ZeRO ``zero_stage``).

    ``pack_sequences``: score each micro-batch as one packed sequence — every distinct prompt
    once (not once per completion) and no padding (`rltt.model.packing`); the same function as
    the padded forward, to floating-point rounding. ``false`` runs the padded forward.

    ``activation_checkpointing``: the training score forward keeps only the input of each
    (loop step, layer) call and recomputes the layer in the backward (non-reentrant
    `torch.utils.checkpoint`; `rltt.model.modeling`) — activation memory per position falls from
    T·L layers' internals to T·L hidden states plus one layer, for one more forward of the block;
    the same values and gradients (bitwise in fp32 on CPU).

    ``lm_head_dtype``: ``model`` (the model's dtype) or ``fp32``: on a bf16/fp16 learner the final
    norm feeding the LM head, the head and the per-loop log-prob kernel run in fp32 (the states
    and the 16-bit head weight are upcast inside the kernel, tile by tile: no fp32 weight copy),
    which brings its log-probs closer to an fp32 rollout's (lower ``mismatch/*``); the gates and
    the carried state stay as computed. A no-op on an fp32 learner.

    ``rounding``: how a bf16 learner's fp32 masters become the module weights (what the loss and the
    engines use) after each update — ``nearest`` (default) or ``stochastic`` (unbiased: an update below
    half a bf16 ulp moves the weight with the matching probability; `rltt.learner.rounding`); torch
    backend only, a no-op on an fp32 learner.

    ``lora``: train LoRA adapters only (`LoraSection`); null (the default) trains every parameter.
    """

    backend: Literal[tuple(BACKENDS)] = "torch"  # type: ignore[valid-type]  # the backend table's names
    zero_stage: Literal[0, 1, 2, 3] = 0
    dtype: Dtype = "fp32"
    lr: PositiveFloat = 1e-5
    warmup_steps: NonNegativeInt = 0
    weight_decay: NonNegativeFloat = 0.0
    betas: list[Beta] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: NonNegativeFloat = 1.0
    micro_batch_size: PositiveInt = 8
    pack_sequences: bool = True
    activation_checkpointing: bool = False
    lm_head_dtype: Literal[tuple(LM_HEAD_DTYPES)] = "model"  # type: ignore[valid-type]  # the table's names
    rounding: Literal[tuple(ROUNDINGS)] = "nearest"  # type: ignore[valid-type]  # masters -> 16-bit weights
    lora: LoraSection | None = None  # null: full fine-tuning

    def __post_init__(self) -> None:
        check_fields(self, "learner")
        if len(self.betas) != 2:
            raise recipe_error("learner.betas", f"need two numbers in [0, 1), got {self.betas}")
        if self.backend == "deepspeed" and self.zero_stage == 0 and self.dtype != "fp32":
            raise recipe_error("learner.zero_stage", f"0 with learner.dtype {self.dtype} would accumulate gradients "
                                                     f"in {self.dtype} (DeepSpeed accumulates a 16-bit model's "
                                                     f"gradients in fp32 only under ZeRO 1-3): use zero_stage 1, 2 "
                                                     f"or 3, or learner.dtype fp32")
        if self.rounding != "nearest" and self.backend != "torch":
            raise recipe_error("learner.rounding", f"{self.rounding} is built for learner.backend torch; "
                                                   f"{self.backend} rounds its masters to nearest")

    @property
    def head_dtype(self):
        """The torch dtype of ``lm_head_dtype`` (None: the model's)."""
        import torch

        name = LM_HEAD_DTYPES[self.lm_head_dtype]
        return None if name is None else getattr(torch, name)
