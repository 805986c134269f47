"""The RL loss of one micro-batch from its loop scores (docs/design.md §3, §5.3–5.4, §5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltt.learner.learner_batch import LearnerBatch
from rltt.learner.settings import AlgorithmConfig
from rltt.learner.scoring import LoopScores
from rltt.objectives import exit_choice_logprob, hybrid_logprob, kl_estimate, policy_logprob, policy_loss
from rltt.objectives.corrections import CorrectionParams
from rltt.objectives.policy_losses import POLICY_LOSSES
from rltt.objectives.rl import aggregate


def chosen_logprob(scores: LoopScores, algo: AlgorithmConfig, learned_logits: torch.Tensor | None = None):
    """The per-token policy log-prob (N,) under ``algo.policy_logprob``; with ``algo.exit_action``
    the joint ``log p_{t*} + log P^(t*)(y)`` of the sampled exit and token."""
    lp = policy_logprob(
        algo.policy_logprob, scores.logprobs, scores.exit_probs, scores.exit_steps,
        omega=algo.omega, alpha=algo.omega_alpha, learned_logits=learned_logits,
        detach_weights=algo.omega_detach,
    )
    return lp + exit_choice_logprob(scores.exit_probs, scores.exit_steps) if algo.exit_action else lp


def sampler_logprob(batch: LearnerBatch, algo: AlgorithmConfig) -> torch.Tensor | None:
    """The sampler's log-prob of each action (B, S), the counterpart of `chosen_logprob` for the
    ``exit`` log-prob: its tempered ``log P^(t*)(y)``, plus its ``log p_{t*}`` with ``exit_action``."""
    if batch.sampler_logprobs is None or not algo.exit_action:
        return batch.sampler_logprobs
    if batch.sampler_exit_logprobs is None:
        raise ValueError("algorithm.exit_action: the batch has no sampler exit log-probs (RolloutBatch.exit_logprobs)")
    return batch.sampler_logprobs + batch.sampler_exit_logprobs


def kl_logprob(scores: LoopScores, algo: AlgorithmConfig, learned_logits=None) -> torch.Tensor:
    """The log-prob the KL is measured on: the final loop (RLTT) or the policy log-prob."""
    return scores.logprobs[-1] if algo.kl_on == "final" else chosen_logprob(scores, algo, learned_logits)


def uses_hybrid(algo: AlgorithmConfig, batch: LearnerBatch) -> bool:
    return algo.hybrid_logprob and algo.policy_logprob == "exit" and batch.sampler_logprobs is not None


def model_token_mask(scores: LoopScores, batch: LearnerBatch) -> torch.Tensor:
    """(B, S) bool: the tokens the loss, its ratio, its aggregation's token counts and the KL cover —
    the scored tokens the model sampled, never the environment's (``batch.env_mask``, a multi-turn
    episode's tool results: attended to, not trained on, whatever scored them)."""
    mask = scores.target_mask
    if batch.env_mask is None:
        return mask
    return mask & ~batch.env_mask.to(device=mask.device, dtype=torch.bool)


@dataclass
class MicroLoss:
    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    stats: dict[str, float]


def rl_loss(scores: LoopScores, batch: LearnerBatch, algo: AlgorithmConfig, max_len: int,
            learned_logits: torch.Tensor | None = None) -> MicroLoss:
    """Policy loss (+ KL in the loss when configured) for ``batch``; aggregation is the
    configured one within the micro-batch (the learner weights micro-batches); environment tokens
    never count (`model_token_mask`)."""
    mask = model_token_mask(scores, batch)
    logp = scores.to_rows(chosen_logprob(scores, algo, learned_logits))
    old = batch.old_logprobs
    if old is None:  # one update per batch: this pass is at the rollout weights
        old = logp.detach()
    at_rollout = old  # the learner's log-prob at the rollout weights, what a rollout correction compares
    sampler = sampler_logprob(batch, algo)
    if uses_hybrid(algo, batch):
        # value = the sampler's log-prob at θ_rollout, gradient = the dense gradient
        logp = hybrid_logprob(logp, sampler, batch.old_logprobs)
        old = sampler
    spec = POLICY_LOSSES[algo.loss]
    eps_low, eps_high = (None if key is None else getattr(algo, key) for key in spec.eps_keys)
    correct = algo.correction != "none"
    pl = policy_loss(
        logp, old, batch.advantages, mask,
        kind=algo.loss, eps_low=eps_low, eps_high=eps_high, agg=algo.aggregation, max_len=max_len,
        correction=algo.correction,
        correction_params=CorrectionParams(algo.correction_cap, algo.correction_lo, algo.correction_hi,
                                           algo.decoupled_cap),
        behaviour_logp=sampler if correct else None, rollout_logp=at_rollout if correct else None,
    )
    loss = pl.loss
    kl = torch.zeros((), device=loss.device)
    if batch.ref_logprobs is not None:
        current = scores.to_rows(kl_logprob(scores, algo, learned_logits))
        per_token = kl_estimate(current, batch.ref_logprobs, algo.kl_estimator)
        kl = aggregate(per_token, mask, algo.aggregation, max_len)
        if algo.kl_in == "loss" and algo.kl_coef > 0:
            loss = loss + algo.kl_coef * kl
    stats = pl.as_dict()
    return MicroLoss(loss=loss, policy_loss=pl.loss.detach(), kl=kl.detach(), stats=stats)
