"""KV cache with one slot per (step, layer) — Ouro's index (t − 1)·L + l (docs/design.md §1.7) — and masks."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class LoopCache(DynamicCache):
    """A `DynamicCache` holding T·L slots: token j at step t attends to the step-t keys/values
    of tokens ≤ j. Works with `model.generate()` like any transformers cache."""

    @staticmethod
    def slot(step: int, layer_idx: int, num_layers: int) -> int:
        return (step - 1) * num_layers + layer_idx


def ensure_slots(cache: Cache, num_slots: int) -> Cache:
    """Grow a cache that transformers built for L layers (e.g. in `generate`) to T·L slots."""
    layers = getattr(cache, "layers", None)
    if layers is not None and getattr(cache, "layer_class_to_replicate", None) is None:
        while len(layers) < num_slots:
            layers.append(DynamicLayer())
    return cache


def attention_mask_for(
    attention_mask: torch.Tensor | None, query_len: int, past_len: int, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for SDPA over past_len cached + query_len new positions.

    Without padding and without a cached prefix the mask is None and SDPA's causal flag is
    used (as transformers does, so converted models match bit for bit). Otherwise a boolean
    (B, 1, S, past+S) mask: causal, minus padded keys; a padded query keeps its own key so no
    row is empty (its output is never used).
    """
    kv_len = past_len + query_len
    padded = attention_mask is not None and not bool(attention_mask[:, -kv_len:].all())
    if not padded and past_len == 0:
        return None, query_len > 1
    if not padded and query_len == 1:
        return None, False
    q_pos = torch.arange(past_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None]  # (1, 1, S, K)
    if padded:
        keep = attention_mask[:, -kv_len:].to(device=device, dtype=torch.bool)[:, None, None, :]
        mask = (mask & keep) | (k_pos == q_pos)[None, None]
    return mask, False
