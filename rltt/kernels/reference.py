"""Naive per-loop log-probs: materialise all T x N x V logits.

Used only by tests and benchmarks as the ground truth; it holds the full logits tensor (and
autograd keeps several of its size), which is exactly what the fused kernels avoid.
"""

from __future__ import annotations

import torch

from rltt.kernels._common import KEPT_ROUNDING, LoopLogProbs


def reference_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    kept_floor: torch.Tensor | None = None,
    kept_dtype: torch.dtype | None = None,
) -> LoopLogProbs:
    """log_softmax(hidden @ weight.T / temperature) gathered at targets, and the entropy.

    hidden (T, N, d), weight (V, d), targets (N,), mask (N,) bool or None. Computes in fp32
    and returns fp32 (T, N) tensors; masked positions are 0 (and get no gradient).
    ``kept_floor`` (N,) or None: the log-prob of token j is renormalised over the logits at least
    its floor token's (from the same materialised logits), plus the floor and the target; -1
    keeps everything (`rltt.kernels.per_loop_logprobs`); ``kept_dtype`` bf16/fp16: membership
    compares the untempered logits rounded to it, then tempered (`KEPT_ROUNDING`).
    """
    logits = hidden.float() @ weight.float().T / temperature
    logp = torch.log_softmax(logits, dim=-1)
    safe_targets = targets.long()
    if mask is not None:
        safe_targets = torch.where(mask, safe_targets, torch.zeros_like(safe_targets))
    index = safe_targets.view(1, -1, 1).expand(logp.shape[0], -1, 1)
    logprobs = logp.gather(-1, index).squeeze(-1)
    if kept_floor is not None:
        floor = kept_floor.long()
        if mask is not None:
            floor = torch.where(mask, floor, torch.full_like(floor, -1))
        steps, vocab = logits.shape[0], logits.shape[-1]
        round_to = KEPT_ROUNDING.get(kept_dtype)
        keys = logits.detach()
        if round_to is not None:
            keys = (hidden.detach().float() @ weight.detach().float().T).to(round_to).float() / temperature
        at = keys.gather(-1, floor.clamp_min(0).view(1, -1, 1).expand(steps, -1, 1))
        cols = torch.arange(vocab, device=logits.device)
        kept = (keys >= at) | (cols == floor.view(1, -1, 1)) | (cols == safe_targets.view(1, -1, 1))
        kept = kept | (floor < 0).view(1, -1, 1)
        kept_lp = torch.log_softmax(logits.masked_fill(~kept, float("-inf")), dim=-1).gather(-1, index).squeeze(-1)
        logprobs = torch.where((floor >= 0).view(1, -1), kept_lp, logprobs)
    entropy = -(logp.exp() * logp).sum(-1)
    if mask is not None:
        keep = mask.view(1, -1)
        logprobs = torch.where(keep, logprobs, torch.zeros_like(logprobs))
        entropy = torch.where(keep, entropy, torch.zeros_like(entropy))
    return LoopLogProbs(logprobs, entropy)
