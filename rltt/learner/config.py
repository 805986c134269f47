"""Typed settings of the RL learner: the algorithm (SPEC §2.3–2.4, §4) and the optimisation backend."""

from __future__ import annotations

from dataclasses import dataclass, field

from rltt.errors import ConfigError
from rltt.objectives import ADVANTAGE_SCALES, AGGREGATIONS, KL_ESTIMATORS, OMEGAS, POLICY_LOGPROB_KINDS, POLICY_LOSS_KINDS


def _one_of(field: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{field}: must be one of {' | '.join(map(str, allowed))}, got {value!r}")


@dataclass
class AlgorithmConfig:
    """RLTT / GRPO objective.

    ``policy_logprob``: exit | final | mixture | rltt (ω = ``omega``: exit_pdf | uniform |
    progressive | learned). ``loss``: ppo_clip (ε_low/ε_high, ``ppo_epochs`` = μ) or reinforce.
    ``hybrid_logprob``: use logp_dense(θ) + sg(logp_rollout − logp_dense(θ_rollout)) for the
    ``exit`` log-prob (SPEC §2.4). ``kl_in``: loss | reward; ``kl_on``: final (loop T, RLTT) or
    policy (the chosen log-prob). ``tis_cap``: truncated importance-sampling cap (None = off).
    ``track_kl``: keep the frozen reference (one extra no-grad forward) to log ``kl/ref``
    even with ``kl_coef = 0`` — the first sign that the policy is (not) moving.
    ``dynamic_sampling``: drop groups whose rewards are all equal and refill the batch.
    """

    policy_logprob: str = "exit"
    omega: str = "exit_pdf"
    omega_alpha: float = 1.0
    omega_detach: bool = True
    loss: str = "ppo_clip"
    eps_low: float = 0.2
    eps_high: float = 0.28
    ppo_epochs: int = 1
    aggregation: str = "token_mean"
    advantage_scale: str = "group"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in: str = "loss"
    kl_on: str = "final"
    tis_cap: float | None = None
    hybrid_logprob: bool = True
    track_kl: bool = True  # keep a frozen reference to log kl/ref even when kl_coef = 0
    dynamic_sampling: bool = False
    max_refills: int = 4

    def __post_init__(self) -> None:
        _one_of("algorithm.policy_logprob", self.policy_logprob, POLICY_LOGPROB_KINDS)
        _one_of("algorithm.omega", self.omega, OMEGAS)
        _one_of("algorithm.loss", self.loss, POLICY_LOSS_KINDS)
        _one_of("algorithm.aggregation", self.aggregation, AGGREGATIONS)
        _one_of("algorithm.advantage_scale", self.advantage_scale, ADVANTAGE_SCALES)
        _one_of("algorithm.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _one_of("algorithm.kl_in", self.kl_in, ("loss", "reward"))
        _one_of("algorithm.kl_on", self.kl_on, ("final", "policy"))
        if self.ppo_epochs < 1:
            raise ConfigError(f"algorithm.ppo_epochs: must be >= 1, got {self.ppo_epochs}")
        if not 0 <= self.eps_low < 1 or self.eps_high < 0:
            raise ConfigError(f"algorithm.eps_low/eps_high: need 0 <= eps_low < 1 and eps_high >= 0, "
                              f"got {self.eps_low}/{self.eps_high}")
        if self.kl_coef < 0:
            raise ConfigError(f"algorithm.kl_coef: must be >= 0, got {self.kl_coef}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"algorithm.tis_cap: must be > 0, got {self.tis_cap}")


@dataclass
class LearnerConfig:
    """Optimisation: ``backend`` torch (plain PyTorch AdamW) or deepspeed (ZeRO ``zero_stage``).

    ``pack_sequences``: score each micro-batch as one packed sequence — every distinct prompt
    once (not once per completion) and no padding (`rltt.model.packing`); the same function as
    the padded forward, to floating-point rounding. ``false`` runs the padded forward.
    """

    backend: str = "torch"
    zero_stage: int = 0
    dtype: str = "fp32"
    lr: float = 1e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    pack_sequences: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _one_of("learner.backend", self.backend, ("torch", "deepspeed"))
        _one_of("learner.zero_stage", self.zero_stage, (0, 1, 2, 3))
        _one_of("learner.dtype", self.dtype, ("fp32", "bf16"))
        if self.lr <= 0:
            raise ConfigError(f"learner.lr: must be > 0, got {self.lr}")
        if self.micro_batch_size < 1:
            raise ConfigError(f"learner.micro_batch_size: must be >= 1, got {self.micro_batch_size}")
        if len(self.betas) != 2:
            raise ConfigError(f"learner.betas: need two numbers, got {self.betas}")
