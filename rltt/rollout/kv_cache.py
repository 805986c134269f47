"""Per-(step, layer) KV cache of the native engine and the depth-mixed attention over it.

`StepKVCache` preallocates, for every layer l, keys and values of shape
(T, R, Hkv, max_len, D): slot (t, l) of docs/design.md §1.7 is ``keys[l][t − 1]``, and token p of row r
at step t lives at ``[t − 1, r, :, p]``. Nothing is ever moved or concatenated.

`GroupedAttend` is the ``attend`` callable one pass hands to the shared block. The pass holds
work items (row, position, step) at different steps (depth-mixed batching): projections and
MLPs run batched over all items; each item writes its (k, v) into its own step's slot, then
attention runs over the slots — one SDPA call for the single-token entries and one for the
multi-token ones, whatever their steps — each item attending to the keys of its row and step at
positions ≤ its own (causal among items of the same row and step).

`SlotAttend` is its sibling for ``rollout.attention: triton`` (`rltt.rollout.attention`): the same
writes, then one Triton launch per layer for every item, reading each item's slot in place. In a
bucketed pass with CUDA graphs it is captured with the rest of the pass (`SlotInputs`,
`StaticSlotAttend`; `rltt.rollout.buckets`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rltt.model.layers import additive_mask
from rltt.rollout.host_work import note_upload


@contextmanager
def without_cudnn_attention():
    """The engine's passes with SDPA's cuDNN backend off (restored after). cuDNN attention builds an
    execution plan per new shape (reported elsewhere at tens to hundreds of milliseconds; the first GPU
    check's warm-ups point to it, not yet measured directly), and a pass's attention shapes change with
    every token (key length, entries, widths); the other backends need no per-shape build. The engine
    and `replay_logprobs` both run their passes under it, so a replay uses the same backend. No effect
    on CPU (no cuDNN backend there)."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def upload(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Int64 device copies of host index ``lists``, made from ONE host tensor: one host-to-device copy
    (from pinned memory, not waiting for the device, on CUDA) instead of one ``torch.tensor`` each."""
    flat = [v for values in lists for v in values]
    host = torch.tensor(flat, dtype=torch.long)
    note_upload()
    if device.type != "cpu":
        host = host.pin_memory().to(device, non_blocking=True)
    out, at = [], 0
    for values in lists:
        out.append(host[at: at + len(values)])
        at += len(values)
    return out


class StepKVCache:
    """Preallocated keys/values for ``num_rows`` sequences of up to ``max_len`` positions."""

    def __init__(self, num_layers: int, num_loops: int, num_rows: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_loops, num_rows, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # views made once, not per layer and pass: (T·R·Hkv·max_len, D) rows for the writes and
        # (T·R, Hkv, max_len, D) slots for the gathers
        self.key_rows = [k.view(-1, head_dim) for k in self.keys]
        self.value_rows = [v.view(-1, head_dim) for v in self.values]
        self.key_slots = [k.flatten(0, 1) for k in self.keys]
        self.value_slots = [v.flatten(0, 1) for v in self.values]
        self.num_rows = num_rows
        self._table: torch.Tensor | None = None

    def slot_table(self) -> torch.Tensor:
        """(L, 6) int64 on the device: every layer's slot views' addresses and strides
        (`rltt.kernels.slot_attention.table_rows`), made once, in one upload: how a captured Triton
        pass reaches this cache."""
        if self._table is None:
            from rltt.kernels.slot_attention import table_rows  # lazy: triton is optional

            rows = table_rows(self.key_slots, self.value_slots)
            self._table = upload([[x for row in rows for x in row]], self.keys[0].device)[0].view(len(rows), -1)
        return self._table


@dataclass
class SlotGroup:
    """Work entries of one pass attended in one SDPA call. An entry is one row's contiguous
    positions at one step; its keys are the cache *slot* of (step, row): ``keys[step − 1, row]``,
    row ``(step − 1)·R + row`` of the cache viewed as (T·R, Hkv, max_len, D)."""

    items: torch.Tensor | None  # (n,) the pass's item indices in this group, None = all, in order
    slots: torch.Tensor  # (m,) flat cache slots of the entries
    step_view: int | None  # every row of the cache at this one step: read the slot as a view, no gather
    key_len: int  # keys 0..key_len-1 are read
    mask: torch.Tensor  # (m, 1, n_rep·width, key_len) additive, 0 = attend, −inf = not (what SDPA makes of a
    # bool mask on every call, made once per plan)
    width: int  # queries per entry (1 in plain decode)
    slot_row: torch.Tensor | None  # (n,) entry index within the group, when width > 1
    slot_col: torch.Tensor | None  # (n,) query slot within the entry, when width > 1
    pad_rows: torch.Tensor | None = None  # (m,) single-token entries at one step, most rows: attend over
    # every row of that step's cache (a view) with the entries' queries placed at their rows, instead
    # of gathering their keys (a copy of the whole cache slice per layer and pass)


@dataclass
class GroupLayout:
    """The host side of a `SlotGroup`: its entries' index lists (Python ints, from the pass's ranges)
    and sizes. `layout_groups` makes them; the lists travel to the device in the pass's one upload
    (``lists``), and `build` turns their device copies into the group's tensors."""

    m: int  # entries
    n: int  # items
    width: int
    key_len: int
    whole: bool  # the group holds every item of the pass, in order
    ends: list[int]
    slots: list[int]
    counts: list[int] | None  # width > 1
    starts: list[int] | None  # width > 1
    items: list[int] | None  # not whole
    pad_rows: list[int] | None
    step_view: int | None

    def lists(self) -> list[list[int]]:
        return [x for x in (self.ends, self.slots, self.counts, self.starts, self.items, self.pad_rows) if x is not None]

    def build(self, views: list[torch.Tensor], num_cache_rows: int, n_rep: int, dtype: torch.dtype) -> SlotGroup:
        """The group's tensors from the device copies of `lists` (in that order), by tensor ops."""
        views = iter(views)
        ends_t, slots = next(views), next(views)
        counts_t = next(views) if self.counts is not None else None
        starts_t = next(views) if self.starts is not None else None
        items = next(views) if self.items is not None else None
        pad_rows = next(views) if self.pad_rows is not None else None
        device, m, width, key_len = ends_t.device, self.m, self.width, self.key_len
        keys = torch.arange(key_len, device=device)
        if width == 1:
            slot_row = slot_col = None
            query_pos = ends_t[:, None]  # (m, 1)
        else:
            slot_row = torch.repeat_interleave(torch.arange(m, device=device), counts_t, output_size=self.n)
            first = torch.cumsum(counts_t, 0) - counts_t
            slot_col = torch.arange(self.n, device=device) - first[slot_row]
            query_pos = torch.zeros(m, width, dtype=torch.long, device=device)  # padding → key 0
            query_pos[slot_row, slot_col] = starts_t[slot_row] + slot_col
        mask = keys[None, None, :] <= query_pos[:, :, None]  # (m, width, K)
        if n_rep > 1:  # grouped-query heads folded into the query axis: (m, n_rep·width, K)
            mask = mask[:, None].expand(-1, n_rep, -1, -1).reshape(m, n_rep * width, key_len)
        if pad_rows is not None:
            full = torch.zeros(num_cache_rows, n_rep, key_len, dtype=torch.bool, device=device)
            full[:, :, 0] = True  # rows without an entry: any finite row (its output is dropped)
            full[pad_rows] = mask
            mask = full
        return SlotGroup(items=items, slots=slots, step_view=self.step_view, key_len=key_len,
                         mask=additive_mask(mask[:, None], dtype), width=width, slot_row=slot_row,
                         slot_col=slot_col, pad_rows=pad_rows)


def plan_groups(rows: list[int], starts: list[int], ends: list[int], steps: list[int], num_cache_rows: int,
                n_rep: int, device: torch.device, dtype: torch.dtype = torch.float32) -> list[SlotGroup]:
    """The attention groups of a pass on their own (`layout_groups`, one upload, `GroupLayout.build`);
    `PassExecutor` folds the layouts' lists into its pass's single upload instead."""
    layouts = layout_groups(rows, starts, ends, steps, num_cache_rows)
    views = upload([x for g in layouts for x in g.lists()], device)
    groups, at = [], 0
    for g in layouts:
        k = len(g.lists())
        groups.append(g.build(views[at: at + k], num_cache_rows, n_rep, dtype))
        at += k
    return groups


def layout_groups(rows: list[int], starts: list[int], ends: list[int], steps: list[int],
                  num_cache_rows: int) -> list[GroupLayout]:
    """Group a pass's (row, start..end, step) entries for attention: one group of the single-token
    entries (plain decode) and one of the multi-token entries (prefill, pending positions), whatever
    their steps — so a depth-mixed pass costs as many attention calls as a uniform one, and
    single-token entries are not padded to the width of the others. Host work only (Python lists)."""
    counts = [e - s + 1 for s, e in zip(starts, ends)]
    offsets = [0] * len(counts)
    for i in range(1, len(counts)):
        offsets[i] = offsets[i - 1] + counts[i - 1]
    single = [i for i, c in enumerate(counts) if c == 1]
    multi = [i for i, c in enumerate(counts) if c > 1]
    layouts = []
    for entries in (single, multi):
        if not entries:
            continue
        g_rows, g_steps = [rows[i] for i in entries], [steps[i] for i in entries]
        g_counts = [counts[i] for i in entries]
        width = max(g_counts)
        whole = len(entries) == len(counts)
        if whole:
            items = None
        elif width == 1:
            items = [offsets[i] for i in entries]
        else:
            items = [offsets[i] + k for i in entries for k in range(counts[i])]
        uniform = all(st == g_steps[0] for st in g_steps)
        step_view = g_steps[0] if uniform and g_rows == list(range(num_cache_rows)) else None
        pad_rows = None
        if step_view is None and uniform and width == 1 and 2 * len(entries) >= num_cache_rows:
            step_view, pad_rows = g_steps[0], g_rows
        layouts.append(GroupLayout(
            m=len(entries), n=sum(g_counts), width=width, key_len=max(ends[i] for i in entries) + 1, whole=whole,
            ends=[ends[i] for i in entries], slots=[(st - 1) * num_cache_rows + r for st, r in zip(g_steps, g_rows)],
            counts=g_counts if width > 1 else None, starts=[starts[i] for i in entries] if width > 1 else None,
            items=items, pad_rows=pad_rows, step_view=step_view))
    return layouts


def _step_slot(cache: torch.Tensor, step: int, key_len: int) -> torch.Tensor:
    """``cache[step − 1, :, :, :key_len]`` of a (T, R, Hkv, max_len, D) cache tensor: the same view
    (sizes, strides, offset) made by one ``as_strided`` instead of a select and a slice."""
    _, rows, heads, _, head_dim = cache.shape
    stride = cache.stride()
    return cache.as_strided((rows, heads, key_len, head_dim), stride[1:],
                            cache.storage_offset() + (step - 1) * stride[0])


class GroupedAttend:
    """``attend(q, k, v, layer)`` for one pass: items are rows of q/k/v (N, H, 1, D)."""

    def __init__(self, cache: StepKVCache, groups: list[SlotGroup], write_rows: torch.Tensor, scale: float):
        self.cache, self.groups, self.write_rows, self.scale = cache, groups, write_rows, scale

    @staticmethod
    def write_rows_of(cache: StepKVCache, item_rows: torch.Tensor, item_pos: torch.Tensor,
                      item_steps: torch.Tensor) -> torch.Tensor:
        """Each item's (k, v) rows in the cache viewed as (T·R·Hkv·max_len, D), head-major per
        item: one ``index_copy_`` per write."""
        _, R, H, L, _ = cache.keys[0].shape
        heads = torch.arange(H, device=item_rows.device)
        base = ((item_steps - 1) * R + item_rows) * (H * L) + item_pos
        return (base[:, None] + heads[None, :] * L).reshape(-1)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
        cache = self.cache
        keys = cache.keys[layer_idx]
        n_items, num_heads, _, head_dim = q.shape
        num_kv = k.shape[1]
        n_rep = num_heads // num_kv
        # one position per item: (N, H, 1, D) read as (N·H, D) rows, head-major per item
        cache.key_rows[layer_idx].index_copy_(0, self.write_rows, k.reshape(-1, head_dim))
        cache.value_rows[layer_idx].index_copy_(0, self.write_rows, v.reshape(-1, head_dim))
        q_items = q.view(n_items, num_heads, head_dim)
        outs = []
        for g in self.groups:
            if g.step_view is not None:  # keys[step − 1, :, :, :key_len] as one view operator, not two
                g_keys = _step_slot(keys, g.step_view, g.key_len)
                g_values = _step_slot(cache.values[layer_idx], g.step_view, g.key_len)
            else:
                g_keys = cache.key_slots[layer_idx][:, :, : g.key_len].index_select(0, g.slots)
                g_values = cache.value_slots[layer_idx][:, :, : g.key_len].index_select(0, g.slots)
            m = g.slots.shape[0]
            g_q = q_items if g.items is None else q_items.index_select(0, g.items)  # (n, Hq, D)
            if g.pad_rows is not None:
                m = keys.shape[1]
                g_q = g_q.new_zeros(m, num_heads, head_dim).index_copy_(0, g.pad_rows, g_q)
            if g.width == 1:
                g_q = g_q.view(m, num_kv, n_rep, head_dim)
            else:
                padded = g_q.new_zeros(m, g.width, num_heads, head_dim)
                padded[g.slot_row, g.slot_col] = g_q
                g_q = padded.view(m, g.width, num_kv, n_rep, head_dim).permute(0, 2, 3, 1, 4).reshape(
                    m, num_kv, n_rep * g.width, head_dim)
            out = F.scaled_dot_product_attention(g_q, g_keys, g_values, attn_mask=g.mask, scale=self.scale)
            if g.width == 1:
                if g.items is None and g.pad_rows is None and len(self.groups) == 1:
                    return out.reshape(n_items, num_heads, 1, head_dim)  # every item: (N, Hq, 1, D)
                out = out.reshape(m, num_heads, head_dim)
                if g.pad_rows is not None:
                    out = out.index_select(0, g.pad_rows)
            else:
                out = out.view(m, num_kv, n_rep, g.width, head_dim).permute(0, 3, 1, 2, 4)
                out = out.reshape(m, g.width, num_heads, head_dim)[g.slot_row, g.slot_col]
            outs.append(out)
        if len(outs) == 1 and self.groups[0].items is None:
            return outs[0].unsqueeze(2)  # (N, Hq, 1, D)
        out = q.new_empty(n_items, num_heads, head_dim)
        for g, o in zip(self.groups, outs):
            out[g.items] = o
        return out.unsqueeze(2)


class SlotAttend:
    """``attend(q, k, v, layer)`` for one pass with ``rollout.attention: triton``: the items' keys and
    values are written as `GroupedAttend` writes them, then ONE launch of
    `rltt.kernels.slot_attention.slot_attention` attends every item over its own cache slot read in
    place — whatever the items' steps and entry widths, no gather. ``slots`` (N,): each item's slot
    ``(step − 1)·R + row`` in the cache viewed as (T·R, Hkv, max_len, D); ``positions`` (N,): its
    position (keys 0..position are read)."""

    def __init__(self, cache: StepKVCache, write_rows: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 scale: float):
        from rltt.kernels.slot_attention import slot_attention  # lazy: triton is optional

        self.kernel = slot_attention
        self.cache, self.write_rows, self.slots, self.positions, self.scale = cache, write_rows, slots, positions, scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
        cache = self.cache
        n_items, num_heads, _, head_dim = q.shape
        cache.key_rows[layer_idx].index_copy_(0, self.write_rows, k.reshape(-1, head_dim))
        cache.value_rows[layer_idx].index_copy_(0, self.write_rows, v.reshape(-1, head_dim))
        out = self.kernel(q.view(n_items, num_heads, head_dim), cache.key_slots[layer_idx],
                          cache.value_slots[layer_idx], self.slots, self.positions, self.scale)
        return out.unsqueeze(2)  # (N, Hq, 1, D)

    # -- the whole pass captured (rltt.rollout.buckets) -------------------------------------------
    def load(self, inputs: "SlotInputs", n: int) -> None:
        """Before a captured pass's replay: this pass's ``n`` real items (their slots and positions),
        their count and the cache's table, copied into a bucket's static inputs (device copies: no
        sync). Items ``n`` and above keep stale values, which the kernels do not read."""
        inputs.slots[:n].copy_(self.slots)
        inputs.positions[:n].copy_(self.positions)
        inputs.count.fill_(n)
        table = self.cache.slot_table()
        if inputs.loaded is not table:  # one table per cache: copied when the cache changes
            inputs.table.copy_(table)
            inputs.loaded = table

    def static(self, inputs: "SlotInputs") -> "StaticSlotAttend":
        return StaticSlotAttend(inputs, self.scale)


class SlotInputs:
    """A bucket's static inputs for a captured Triton pass of ``size`` items (`SlotAttend.load` fills
    them before each replay): each item's cache slot and position (the write cell and the keys read),
    the count of real items, and the cache's table (`StepKVCache.slot_table`: every layer's key and
    value addresses and strides) — so one graph serves every rollout's and replay's cache."""

    def __init__(self, size: int, num_layers: int, device: torch.device):
        from rltt.kernels.slot_attention import TABLE_COLUMNS

        self.slots = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.count = torch.zeros(1, dtype=torch.long, device=device)
        self.table = torch.zeros(num_layers, TABLE_COLUMNS.value, dtype=torch.long, device=device)
        self.loaded: torch.Tensor | None = None  # the table last copied in (a cache's `slot_table`)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.slots, self.positions, self.count, self.table))


class StaticSlotAttend:
    """``attend(q, k, v, layer)`` over a bucket's every item, reading only `SlotInputs` (what a captured
    pass may read): one launch writes the real items' keys and values into the cache (items at or past
    the count write nothing), one launch attends each real item over its slot (padded items read
    nothing; their output is 0 and unused). The same kernel and arithmetic as `SlotAttend`: a real
    item's output is bitwise the same."""

    def __init__(self, inputs: SlotInputs, scale: float):
        from rltt.kernels.slot_attention import slot_attention_table, slot_write_table

        self.write, self.attend = slot_write_table, slot_attention_table
        self.inputs, self.scale = inputs, scale

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> torch.Tensor:
        x = self.inputs
        self.write(k[:, :, 0], v[:, :, 0], x.slots, x.positions, x.table, x.count, layer_idx)  # (S, Hkv, D) views
        out = self.attend(q[:, :, 0], x.slots, x.positions, x.table, x.count, layer_idx, self.scale,
                          q.shape[1] // k.shape[1])
        return out.unsqueeze(2)  # (S, Hq, 1, D)
