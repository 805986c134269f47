"""Per-loop scoring of completion tokens: LP[t, j] = log P^(t)(y_j), entropies and exit probabilities.

The learner's forward is the dense one (every position runs all T steps); deferred rollouts
compute the same function (docs/design.md §2.1–2.3), and the recorded exit steps are replayed as data.
Log-probs go through `rltt.kernels` inside the LM head, so no (T, N, V) logits exist. Tokens
sampled from a truncated distribution (top-k/top-p, ``LearnerBatch.kept_floor``) are scored
renormalised over the same kept set (docs/design.md §3.6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltt.learner.learner_batch import LearnerBatch


@dataclass
class LoopScores:
    """Flat over the N completion tokens of a batch (row-major order of ``target_mask``)."""

    logprobs: torch.Tensor  # (T, N) LP
    entropy: torch.Tensor  # (T, N) per-loop entropy
    exit_probs: torch.Tensor  # (T, N) p_t of the state that produced each token
    exit_steps: torch.Tensor  # (N,) recorded t*
    target_mask: torch.Tensor  # (B, S) where the N tokens sit

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Scatter per-token values (N,) into a zero-padded (B, S) tensor (differentiable)."""
        out = values.new_zeros(self.target_mask.shape)
        return out.masked_scatter(self.target_mask, values)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The `LoopedForCausalLM` inside a DeepSpeed engine or DDP wrapper."""
    while hasattr(model, "module") and not hasattr(model, "lm_head"):
        model = model.module
    return model


def score_tokens(model: torch.nn.Module, batch: LearnerBatch, pack: bool = False,
                 head_dtype: torch.dtype | None = None) -> LoopScores:
    """Per-loop log-probs (at the batch temperature, over each token's kept set), entropies and
    exit probabilities of the completion tokens of ``batch``. ``model`` may be wrapped (DeepSpeed
    engine): the call goes through its forward, in the model's score mode. ``pack``: the
    prefix-shared, unpadded score forward (`rltt.model.packing`). ``head_dtype``: torch.float32 runs
    the LM head's final norm and the head in fp32 on a 16-bit model (`LearnerConfig.lm_head_dtype`)."""
    extra = {} if head_dtype is None else {"head_dtype": head_dtype}
    if batch.kept_floor is not None:
        extra["kept_floor"] = batch.kept_floor
        if batch.kept_dtype is not None:
            extra["kept_dtype"] = batch.kept_dtype
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, score_mask=batch.target_mask,
                temperature=batch.temperature, use_cache=False, pack=pack, **extra)
    mask = batch.target_mask.bool()
    return LoopScores(out.token_logprobs, out.token_entropy, out.token_exit_probs, batch.exit_steps[mask], mask)
