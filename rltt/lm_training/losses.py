"""The LM-stage loss of one batch: per-loop log-probs (fused kernel) → looped objective."""

from __future__ import annotations

import torch

from rltt.kernels import per_loop_logprobs
from rltt.objectives.lm import LoopedLMLoss, looped_lm_loss, smoothed_exit_loss, step_losses_from_logprobs


def batch_loss(model, input_ids: torch.Tensor, beta: float, eps: float = 0.0) -> tuple[LoopedLMLoss, torch.Tensor]:
    """Next-token objective of a (B, S) block batch; returns the loss and exit_probs (T, B, S−1).

    ``eps = 0`` is the pretraining objective ``Σ p_t L_t − β H(p)``; ``eps > 0`` the conversion
    one (smoothed exit loss). The LM head is applied per vocabulary chunk by the kernel, so
    T×N×V logits are never materialised.
    """
    out = model(input_ids=input_ids, use_cache=False, output_step_hidden=True, logits_to_keep=1)
    hidden = out.step_hidden[:, :, :-1]  # (T, B, S-1, d): position j predicts token j+1
    steps, bsz, seq, dim = hidden.shape
    targets = input_ids[:, 1:].reshape(-1)
    logprobs = per_loop_logprobs(hidden.reshape(steps, bsz * seq, dim), model.lm_head.weight, targets).logprobs
    step_losses = step_losses_from_logprobs(logprobs.view(steps, bsz, seq))
    exit_probs = out.exit_probs[:, :, :-1]
    if eps > 0:
        return smoothed_exit_loss(step_losses, exit_probs, eps=eps, beta=beta), exit_probs
    return looped_lm_loss(step_losses, exit_probs, beta=beta), exit_probs
