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
