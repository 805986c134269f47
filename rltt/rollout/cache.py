"""Per-(step, layer) KV cache of the native engine and the depth-mixed attention over it.

`StepKVCache` preallocates, for every layer l, keys and values of shape
(T, R, Hkv, max_len, D): slot (t, l) of SPEC §1.3 is ``keys[l][t − 1]``, and token p of row r
at step t lives at ``[t − 1, r, :, p]``. Nothing is ever moved or concatenated.

`GroupedAttend` is the ``attend`` callable one pass hands to the shared block. The pass holds
work items (row, position, step) at different steps (depth-mixed batching): projections and
MLPs run batched over all items; each item writes its (k, v) into its own step's slot, then
attention runs once per step group over that step's slot, each item attending to the keys of
its row at positions ≤ its own (causal among items of the same row and step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class StepKVCache:
    """Preallocated keys/values for ``num_rows`` sequences of up to ``max_len`` positions."""

    def __init__(self, num_layers: int, num_loops: int, num_rows: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_loops, num_rows, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_rows = num_rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


@dataclass
class StepGroup:
    """The items of one step within a pass: items ``lo:hi`` (contiguous, the pass is sorted by
    step) from ``rows`` (m,), padded to ``width`` queries per row when a row has several."""

    step: int
    lo: int
    hi: int
    rows: torch.Tensor  # (m,) cache rows
    all_rows: bool  # rows == 0..R-1: read the slot as a view, no gather
    key_len: int  # keys 0..key_len-1 are read
    mask: torch.Tensor  # (m, 1, n_rep·width, key_len) bool, True = attend
    width: int  # queries per row (1 in plain decode)
    slot_row: torch.Tensor | None  # (hi − lo,) row index within the group, when width > 1
    slot_col: torch.Tensor | None  # (hi − lo,) query slot within the row, when width > 1


def plan_groups(rows: list[int], starts: list[int], ends: list[int], steps: list[int], num_cache_rows: int,
                n_rep: int, device: torch.device) -> list[StepGroup]:
    """Group a pass's (row, start..end, step) work by step; ``rows`` etc. are sorted by step."""
    groups, lo, i = [], 0, 0
    while i < len(rows):
        j = i
        while j < len(rows) and steps[j] == steps[i]:
            j += 1
        g_rows, g_starts, g_ends = rows[i:j], starts[i:j], ends[i:j]
        counts = [e - s + 1 for s, e in zip(g_starts, g_ends)]
        width, key_len, n = max(counts), max(g_ends) + 1, sum(counts)
        keys = torch.arange(key_len, device=device)
        ends_t = torch.tensor(g_ends, device=device)
        if width == 1:
            slot_row = slot_col = None
            query_pos = ends_t[:, None]  # (m, 1)
        else:
            counts_t = torch.tensor(counts, device=device)
            slot_row = torch.repeat_interleave(torch.arange(len(g_rows), device=device), counts_t)
            offsets = torch.cumsum(counts_t, 0) - counts_t
            slot_col = torch.arange(n, device=device) - offsets[slot_row]
            query_pos = torch.zeros(len(g_rows), width, dtype=torch.long, device=device)  # padding → key 0
            query_pos[slot_row, slot_col] = torch.tensor(g_starts, device=device)[slot_row] + slot_col
        mask = keys[None, None, :] <= query_pos[:, :, None]  # (m, width, K)
        if n_rep > 1:  # grouped-query heads folded into the query axis: (m, n_rep·width, K)
            mask = mask[:, None].expand(-1, n_rep, -1, -1).reshape(len(g_rows), n_rep * width, key_len)
        groups.append(StepGroup(
            step=steps[i], lo=lo, hi=lo + n, rows=torch.tensor(g_rows, device=device),
            all_rows=g_rows == list(range(num_cache_rows)), key_len=key_len, mask=mask[:, None],
            width=width, slot_row=slot_row, slot_col=slot_col,
        ))
        lo, i = lo + n, j
    return groups


class GroupedAttend:
    """``attend(q, k, v, layer)`` for one pass: items are rows of q/k/v (N, H, 1, D)."""

    def __init__(self, cache: StepKVCache, groups: list[StepGroup], item_rows: torch.Tensor,
                 item_pos: torch.Tensor, item_steps: torch.Tensor, scale: float):
        self.cache, self.groups, self.scale = cache, groups, scale
        self.write_index = (item_steps - 1, item_rows)
        self.item_pos = item_pos

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        steps_idx, rows_idx = self.write_index
        keys[steps_idx, rows_idx, :, self.item_pos] = k[:, :, 0]
        values[steps_idx, rows_idx, :, self.item_pos] = v[:, :, 0]
        n_items, num_heads, _, head_dim = q.shape
        num_kv = k.shape[1]
        n_rep = num_heads // num_kv
        outs = []
        for g in self.groups:
            g_keys = keys[g.step - 1, :, :, : g.key_len]
            g_values = values[g.step - 1, :, :, : g.key_len]
            if not g.all_rows:
                g_keys, g_values = g_keys.index_select(0, g.rows), g_values.index_select(0, g.rows)
            m = g.rows.shape[0]
            g_q = q[g.lo: g.hi, :, 0]  # (n, Hq, D)
            if g.width == 1:
                g_q = g_q.view(m, num_kv, n_rep, head_dim)
            else:
                padded = g_q.new_zeros(m, g.width, num_heads, head_dim)
                padded[g.slot_row, g.slot_col] = g_q
                g_q = padded.view(m, g.width, num_kv, n_rep, head_dim).permute(0, 2, 3, 1, 4)
            g_q = g_q.reshape(m, num_kv, n_rep * g.width, head_dim)
            out = F.scaled_dot_product_attention(g_q, g_keys, g_values, attn_mask=g.mask, scale=self.scale)
            if g.width == 1:
                out = out.reshape(m, num_heads, head_dim)
            else:
                out = out.view(m, num_kv, n_rep, g.width, head_dim).permute(0, 3, 1, 2, 4)
                out = out.reshape(m, g.width, num_heads, head_dim)[g.slot_row, g.slot_col]
            outs.append(out)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        return out.unsqueeze(2)  # (N, Hq, 1, D)
