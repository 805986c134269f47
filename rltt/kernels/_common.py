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


#: The rounding of the logits the kept set of top-k/top-p is decided on, by the dtype the sampler's
#: logits had (`per_loop_logprobs`'s ``kept_dtype``, a rollout's LM-head dtype): a 16-bit rollout took
#: its kept set from its head's 16-bit output, so the kernels round each fp32 logit to that dtype
#: (round to nearest even) before comparing it with the floor's; fp32 (None): the logits as computed.
KEPT_ROUNDING = {torch.float32: None, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}

#: tokens per block when computing the floor thresholds (bounds the (T, block, d) fp32 temporary)
THRESHOLD_BLOCK = 2048


@torch.no_grad()
def floor_thresholds(hidden: torch.Tensor, weight: torch.Tensor, floor: torch.Tensor, inv_temp: float,
                     round_to: torch.dtype | None = None) -> torch.Tensor:
    """(T, N) fp32: each loop's tempered logit of token j's kept-set floor ``floor[j]`` — the
    threshold of its kept set ``{i : z_i >= z_floor}`` — and -inf where ``floor[j] < 0`` (no
    truncation). ``round_to`` (`KEPT_ROUNDING`): the logit is rounded to that dtype before the
    temperature, as the kernels round every logit they compare with it. A constant of the backward
    (the kept set is piecewise constant in the weights)."""
    steps, n, _ = hidden.shape
    out = torch.full((steps, n), float("-inf"), dtype=torch.float32, device=hidden.device)
    index = (floor >= 0).nonzero().squeeze(1)
    for block in index.split(THRESHOLD_BLOCK):
        w = weight.index_select(0, floor[block]).float()  # (b, d)
        h = hidden.index_select(1, block).float()  # (T, b, d)
        z = (h * w).sum(-1)
        out[:, block] = (z if round_to is None else z.to(round_to).float()) * inv_temp
    return out
