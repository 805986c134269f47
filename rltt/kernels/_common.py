"""Shared pieces of the per-loop log-prob kernels: the result type and chunk sizing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Default budget for one vocabulary chunk of fp32 logits (elements): 2**24 floats = 64 MiB.
CHUNK_BUDGET_ELEMENTS = 1 << 24
MIN_CHUNK = 512
MAX_CHUNK = 8192


@dataclass(frozen=True)
class LoopLogProbs:
    """Per-loop log-probs of the targets and per-loop entropies, both fp32.

    ``logprobs[t, j] = log softmax(lm_head(h_t[j]) / temperature)[targets[j]]`` and
    ``entropy[t, j]`` is the entropy of that distribution. Unpacks like a tuple:
    ``lp, ent = per_loop_logprobs(...)``.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor

    def __iter__(self):
        return iter((self.logprobs, self.entropy))


def default_chunk_size(rows: int, vocab: int) -> int:
    """Vocabulary chunk width so that one chunk of fp32 logits stays within the budget.

    Clamped to [MIN_CHUNK, MAX_CHUNK], rounded down to a multiple of 128 and never wider
    than the vocabulary.
    """
    width = CHUNK_BUDGET_ELEMENTS // max(rows, 1)
    width = max(MIN_CHUNK, min(MAX_CHUNK, width)) // 128 * 128
    return max(1, min(width, vocab))


#: tokens per block when computing the floor thresholds (bounds the (T, block, d) fp32 temporary)
THRESHOLD_BLOCK = 2048


@torch.no_grad()
def floor_thresholds(hidden: torch.Tensor, weight: torch.Tensor, floor: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """(T, N) fp32: each loop's tempered logit of token j's kept-set floor ``floor[j]`` — the
    threshold of its kept set ``{i : z_i >= z_floor}`` — and -inf where ``floor[j] < 0`` (no
    truncation). A constant of the backward (the kept set is piecewise constant in the weights)."""
    steps, n, _ = hidden.shape
    out = torch.full((steps, n), float("-inf"), dtype=torch.float32, device=hidden.device)
    index = (floor >= 0).nonzero().squeeze(1)
    for block in index.split(THRESHOLD_BLOCK):
        w = weight.index_select(0, floor[block]).float()  # (b, d)
        h = hidden.index_select(1, block).float()  # (T, b, d)
        out[:, block] = (h * w).sum(-1) * inv_temp
    return out
