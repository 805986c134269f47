"""Objectives for looped language models: pure tensor functions (docs/design.md §1, §3, §5.3–5.4, §5).

- :mod:`rltt.objectives.lm`: exit distribution, pretraining and smoothed-exit LM losses
- :mod:`rltt.objectives.logprob`: policy log-prob definitions and the hybrid log-prob
- :mod:`rltt.objectives.advantages`: the advantage estimators (grpo, rloo, reinforce_pp)
- :mod:`rltt.objectives.policy_losses`: the policy losses (ppo_clip, reinforce, gspo, cispo)
- :mod:`rltt.objectives.corrections`: the rollout corrections (truncated IS, masks)
- :mod:`rltt.objectives.rl`: the policy loss composed from those tables, aggregation, KL
"""

from rltt.objectives.lm import (
    LoopedLMLoss,
    exit_distribution,
    exit_entropy,
    looped_lm_loss,
    smoothed_exit_loss,
    step_losses_from_logits,
    step_losses_from_logprobs,
)
from rltt.objectives.logprob import (
    OMEGAS,
    POLICY_LOGPROB_KINDS,
    exit_choice_logprob,
    hybrid_logprob,
    loop_weights,
    policy_logprob,
)
from rltt.objectives.advantages import ADVANTAGE_ESTIMATORS
from rltt.objectives.corrections import CORRECTIONS, CorrectionParams, correction_weights
from rltt.objectives.policy_losses import POLICY_LOSSES
from rltt.objectives.rl import (
    ADVANTAGE_SCALES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSS_KINDS,
    GroupAdvantages,
    PolicyLoss,
    aggregate,
    group_advantages,
    kl_estimate,
    policy_loss,
    uniform_groups,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "OMEGAS",
    "POLICY_LOGPROB_KINDS",
    "POLICY_LOSSES",
    "POLICY_LOSS_KINDS",
    "CorrectionParams",
    "GroupAdvantages",
    "LoopedLMLoss",
    "PolicyLoss",
    "aggregate",
    "correction_weights",
    "exit_choice_logprob",
    "exit_distribution",
    "exit_entropy",
    "group_advantages",
    "hybrid_logprob",
    "kl_estimate",
    "loop_weights",
    "looped_lm_loss",
    "policy_logprob",
    "policy_loss",
    "smoothed_exit_loss",
    "step_losses_from_logits",
    "step_losses_from_logprobs",
    "uniform_groups",
]
