"""Typed settings of the RL learner: the algorithm (the ``algorithm`` recipe section) and the
optimisation backend (``learner``). Choices and ranges are declared on the fields and checked by
`rltt.config`, at recipe load and when built directly in code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rltt.config import (NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Range, check_fields,
                         recipe_error)
from rltt.objectives.logprob import Omega, PolicyLogprobKind
from rltt.objectives.rl import Aggregation, AdvantageScale, KlEstimator, PolicyLossKind
from rltt.sections import Dtype

Beta = Annotated[float, Range(ge=0, lt=1)]


@dataclass
class AlgorithmConfig:
    """RLTT / GRPO objective.

    ``policy_logprob``: exit | final | mixture | rltt (ω = ``omega``: exit_pdf | uniform |
    progressive | learned). ``loss``: ppo_clip (ε_low/ε_high, ``ppo_epochs`` = μ) or reinforce.
    ``hybrid_logprob``: use logp_dense(θ) + sg(logp_rollout − logp_dense(θ_rollout)) for the
    ``exit`` log-prob. ``kl_in``: loss | reward; ``kl_on``: final (loop T, RLTT) or
    policy (the chosen log-prob). ``tis_cap``: truncated importance-sampling cap (None = off).
    ``track_kl``: keep the frozen reference (one extra no-grad forward) to log ``kl/ref``
    even with ``kl_coef = 0`` — the first sign that the policy is (not) moving.
    ``dynamic_sampling``: drop groups whose rewards are all equal and refill the batch.
    """

    policy_logprob: PolicyLogprobKind = "exit"
    omega: Omega = "exit_pdf"
    omega_alpha: float = 1.0
    omega_detach: bool = True
    loss: PolicyLossKind = "ppo_clip"
    eps_low: Annotated[float, Range(ge=0, lt=1)] = 0.2
    eps_high: NonNegativeFloat = 0.28
    ppo_epochs: PositiveInt = 1
    aggregation: Aggregation = "token_mean"
    advantage_scale: AdvantageScale = "group"
    kl_coef: NonNegativeFloat = 0.0
    kl_estimator: KlEstimator = "k3"
    kl_in: Literal["loss", "reward"] = "loss"
    kl_on: Literal["final", "policy"] = "final"
    tis_cap: PositiveFloat | None = None
    hybrid_logprob: bool = True
    track_kl: bool = True  # keep a frozen reference to log kl/ref even when kl_coef = 0
    dynamic_sampling: bool = False
    max_refills: NonNegativeInt = 4

    def __post_init__(self) -> None:
        check_fields(self, "algorithm")


@dataclass
class LearnerConfig:
    """Optimisation: ``backend`` torch (plain PyTorch AdamW) or deepspeed (ZeRO ``zero_stage``).

    ``pack_sequences``: score each micro-batch as one packed sequence — every distinct prompt
    once (not once per completion) and no padding (`rltt.model.packing`); the same function as
    the padded forward, to floating-point rounding. ``false`` runs the padded forward.
    """

    backend: Literal["torch", "deepspeed"] = "torch"
    zero_stage: Literal[0, 1, 2, 3] = 0
    dtype: Dtype = "fp32"
    lr: PositiveFloat = 1e-5
    warmup_steps: NonNegativeInt = 0
    weight_decay: NonNegativeFloat = 0.0
    betas: list[Beta] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: NonNegativeFloat = 1.0
    micro_batch_size: PositiveInt = 8
    pack_sequences: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "learner")
        if len(self.betas) != 2:
            raise recipe_error("learner.betas", f"need two numbers in [0, 1), got {self.betas}")
