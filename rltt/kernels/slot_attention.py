"""Slot attention: every item of a pass attends over its own cache slot, read in place, in ONE launch.

The native engine's KV cache holds, per layer, keys and values of shape (T, R, Hkv, max_len, D),
viewed as (T·R, Hkv, max_len, D) *slots* (`rltt.rollout.kv_cache.StepKVCache.key_slots`): slot
``(t − 1)·R + r`` holds row r's keys at loop step t. A pass's items are (row, position, step)
triples at any mix of steps; item i reads slot ``slot[i]`` at positions ``0..qpos[i]`` (causal:
its own position included). A multi-token entry (a prefill, pending positions) is just several
items with the same slot and consecutive ``qpos``.

``slot_attention(q, key_slots, value_slots, slot, qpos, scale)`` computes, for every item i and
query head h (GQA: ``n_rep = Hq / Hkv``, head h reads key/value head ``h // n_rep``)::

    keys, values = K[slot[i], h // n_rep, :qpos[i] + 1], V[slot[i], h // n_rep, :qpos[i] + 1]
    out[i, h] = softmax(scale · keys · q[i, h]) · values

with K/V read where they lie (no gather), one program per (item, head): flash-decoding style, an
fp32 online softmax over key blocks of a fixed size (``BLOCK_N``). Output (N, Hq, D) in item
order, in q's dtype (fp32, bf16, fp16). `slot_attention_reference` is the same function in plain
torch (gather, fp32 masked softmax), for tests.

Deterministic: each program walks its keys in a fixed order with fixed block sizes and writes its
own output (no atomics, no split-K), so the same inputs give bitwise the same output on every
call. An item's value depends only on its own q, slot and keys, not on the other items of the
launch (N, their steps, their widths), so padding or regrouping a pass does not change it.

CUDA graphs: the launch grid is ``(N, Hq)`` and every per-item quantity (slot, qpos, and so each
program's loop bound) is read from device tensors, so a bucketed pass (`rltt.rollout.buckets`, a
fixed N) captures it. A captured pass is replayed with every rollout's and replay's own KV cache, so
its launches cannot take the cache as an argument (an address fixed at capture): with
``CACHE_TABLE`` the kernel reads the layer's key and value addresses and strides from a small int64
table in device memory (`table_rows`, uploaded once per cache by `StepKVCache.slot_table` and
copied into the bucket before each replay), and only the items below ``count[0]`` (the real ones)
read keys — a padded item reads nothing and its output is 0. Every arithmetic step is the same
code as the eager launch, so a real item's output is bitwise the same either way.
`slot_write_table` is the captured pass's key/value write: one launch, each real item's key and
value copied bit for bit to its cell, padded items writing nothing. Both are torch
operators (``rltt::slot_attention_table``, ``rltt::slot_write``), so that a CPU emulation of graph
capture (`rltt.rollout.graph_emulation`) records each launch as one operator.

Memory: the kernel allocates only its (N, Hq, D) output; ``slot`` and ``qpos`` are (N,) int64 (and
a captured pass's table L × 6 int64, its count one).

Imported only when the Triton attention is used (triton is an optional dependency). The kernel is
jitted on first use, honouring ``TRITON_INTERPRET`` at that moment (as
`rltt.kernels.triton_logprobs`), so tests can run it on CPU under Triton's interpreter.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from rltt.kernels.triton_compat import fix_interpreter


def _slot_attention_kernel(Q, K, V, SLOT, QPOS, OUT, TABLE, COUNT, layer, scale,
                           q_si, q_sh, q_sd, k_ss, k_sh, k_sl, k_sd, v_ss, v_sh, v_sl, v_sd,
                           o_si, o_sh, o_sd, head_dim, n_rep,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CACHE_TABLE: tl.constexpr):
    item = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // n_rep
    slot = tl.load(SLOT + item).to(tl.int64)
    n_keys = tl.load(QPOS + item).to(tl.int64) + 1  # keys 0..qpos inclusive
    if CACHE_TABLE:  # a captured pass: the cache's addresses and strides, and the real items' count, from memory
        row = TABLE + layer * TABLE_COLUMNS
        K = tl.load(row).to(tl.pointer_type(OUT.dtype.element_ty))
        V = tl.load(row + 1).to(tl.pointer_type(OUT.dtype.element_ty))
        k_ss = tl.load(row + 2)
        k_sh = tl.load(row + 3)
        k_sl = tl.load(row + 4)
        k_sd = tl.load(row + 5)
        v_ss, v_sh, v_sl, v_sd = k_ss, k_sh, k_sl, k_sd
        live = item < tl.load(COUNT)
        n_keys = tl.where(live, n_keys, 0)  # a padded item reads no key
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < head_dim
    q = tl.load(Q + item * q_si + head * q_sh + ds * q_sd, mask=d_ok, other=0.0).to(tl.float32)
    k_base = K + slot * k_ss + kv_head * k_sh
    v_base = V + slot * v_ss + kv_head * v_sh
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N).to(tl.int64)
        k_ok = keys < n_keys
        tile = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + keys[:, None] * k_sl + ds[None, :] * k_sd, mask=tile, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale  # (BLOCK_N,) fp32
        s = tl.where(k_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: the first block holds key 0
        p = tl.exp(s - m_new)  # masked keys: exp(−inf) = 0
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_base + keys[:, None] * v_sl + ds[None, :] * v_sd, mask=tile, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    if CACHE_TABLE:
        l_i = tl.where(live, l_i, 1.0)  # a padded item: 0 / 1, its output is 0
    out = acc / l_i
    tl.store(OUT + item * o_si + head * o_sh + ds * o_sd, out.to(OUT.dtype.element_ty), mask=d_ok)


def _slot_write_kernel(KNEW, VNEW, SLOT, QPOS, TABLE, COUNT, layer, k_si, k_sh, k_sd, v_si, v_sh, v_sd, head_dim,
                       BLOCK_D: tl.constexpr):
    """Program (item, key head): the item's key and value written at its slot and position of the
    layer's cache (addresses and strides from the table); a padded item (>= the count) writes nothing."""
    item = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    row = TABLE + layer * TABLE_COLUMNS
    K = tl.load(row).to(tl.pointer_type(KNEW.dtype.element_ty))
    V = tl.load(row + 1).to(tl.pointer_type(KNEW.dtype.element_ty))
    s_slot, s_head, s_pos, s_d = tl.load(row + 2), tl.load(row + 3), tl.load(row + 4), tl.load(row + 5)
    slot = tl.load(SLOT + item).to(tl.int64)
    pos = tl.load(QPOS + item).to(tl.int64)
    ds = tl.arange(0, BLOCK_D)
    ok = (ds < head_dim) & (item < tl.load(COUNT))
    cell = slot * s_slot + head * s_head + pos * s_pos + ds * s_d
    k = tl.load(KNEW + item * k_si + head * k_sh + ds * k_sd, mask=ok)
    tl.store(K + cell, k, mask=ok)  # bits copied as they are: no conversion
    v = tl.load(VNEW + item * v_si + head * v_sh + ds * v_sd, mask=ok)
    tl.store(V + cell, v, mask=ok)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


#: a cache table's row per layer: the key and value caches' addresses, then the slot, head,
#: position and element strides (in elements) the two share (`table_rows`)
TABLE_COLUMNS = tl.constexpr(6)


@functools.lru_cache(maxsize=4)
def _kernel(interpret: bool, fn=_slot_attention_kernel):
    """The jitted kernel for the current mode (the interpreter is chosen at jit time; the argument
    is the cache key, triton reads TRITON_INTERPRET itself)."""
    if interpret:
        fix_interpreter()  # Triton < 3.7 under NumPy >= 2.4 (rltt.kernels.triton_compat)
    return triton.jit(fn)


#: keys per block: a fixed size per device kind (the result's rounding depends on it, so it is
#: never tuned per call). The interpreter gets a small block so short tests cross block edges.
BLOCK_N = {"cuda": 64, "cpu": 16}


def _block_n(device: torch.device) -> int:
    return BLOCK_N["cuda" if device.type == "cuda" else "cpu"]


def _check(q, key_slots, value_slots, slot, qpos) -> tuple[int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"slot_attention: q must be (N, Hq, D), got {tuple(q.shape)}")
    if key_slots.dim() != 4 or key_slots.shape != value_slots.shape:
        raise ValueError(f"slot_attention: key/value slots must be (S, Hkv, max_len, D) alike, got "
                         f"{tuple(key_slots.shape)} and {tuple(value_slots.shape)}")
    n, hq, d = q.shape
    hkv = key_slots.shape[1]
    if key_slots.shape[3] != d or hq % hkv:
        raise ValueError(f"slot_attention: q heads {hq} / dim {d} do not fit key heads {hkv} / dim "
                         f"{key_slots.shape[3]}")
    if slot.shape != (n,) or qpos.shape != (n,) or slot.dtype.is_floating_point or qpos.dtype.is_floating_point:
        raise ValueError(f"slot_attention: slot and qpos must be integer ({n},), got {slot.dtype} "
                         f"{tuple(slot.shape)} and {qpos.dtype} {tuple(qpos.shape)}")
    if not (q.dtype == key_slots.dtype == value_slots.dtype):
        raise ValueError(f"slot_attention: q, keys and values need one dtype, got {q.dtype}, "
                         f"{key_slots.dtype}, {value_slots.dtype}")
    devices = {t.device for t in (q, key_slots, value_slots, slot, qpos)}
    if len(devices) != 1:
        raise ValueError(f"slot_attention: tensors on several devices {sorted(map(str, devices))}")
    return n, hq, d


def slot_attention(q: torch.Tensor, key_slots: torch.Tensor, value_slots: torch.Tensor, slot: torch.Tensor,
                   qpos: torch.Tensor, scale: float, block_n: int | None = None) -> torch.Tensor:
    """Attention of each item's ``q[i]`` (N, Hq, D) over ``key_slots/value_slots[slot[i], :, :qpos[i] + 1]``
    ((S, Hkv, max_len, D), any strides), in one launch; (N, Hq, D) in q's dtype (module docstring).
    ``qpos[i]`` must be < max_len and ``slot[i]`` < S (not checked: that would read the device).
    ``block_n``: keys per block (default `BLOCK_N` of the device kind)."""
    n, hq, d = _check(q, key_slots, value_slots, slot, qpos)
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    if n == 0 or hq == 0:
        return out
    if block_n is None:
        block_n = _block_n(q.device)
    _kernel(_interpreting())[(n, hq)](
        q, key_slots, value_slots, slot, qpos, out, slot, slot, 0, float(scale),
        *q.stride(), *key_slots.stride(), *value_slots.stride(), *out.stride(), d, hq // key_slots.shape[1],
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d), CACHE_TABLE=False)
    return out


def slot_attention_reference(q: torch.Tensor, key_slots: torch.Tensor, value_slots: torch.Tensor,
                             slot: torch.Tensor, qpos: torch.Tensor, scale: float) -> torch.Tensor:
    """`slot_attention` in plain torch: gather each item's slot (keys 0..max qpos), fp32 scores,
    masked softmax, fp32 weighted sum, cast to q's dtype."""
    n, hq, d = _check(q, key_slots, value_slots, slot, qpos)
    if n == 0:
        return q.new_empty(n, hq, d)
    n_rep = hq // key_slots.shape[1]
    key_len = int(qpos.max()) + 1
    keys = key_slots[:, :, :key_len].index_select(0, slot).float().repeat_interleave(n_rep, dim=1)  # (N, Hq, K, D)
    values = value_slots[:, :, :key_len].index_select(0, slot).float().repeat_interleave(n_rep, dim=1)
    scores = torch.einsum("nhd,nhkd->nhk", q.float(), keys) * scale
    visible = torch.arange(key_len, device=q.device)[None, :] <= qpos[:, None]  # (N, K)
    weights = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("nhk,nhkd->nhd", weights, values).to(q.dtype)


# -- a captured pass (rltt.rollout.buckets): the cache read through a table, padded items inert --------
def table_rows(key_slots: list[torch.Tensor], value_slots: list[torch.Tensor]) -> list[list[int]]:
    """A cache table's rows (`TABLE_COLUMNS` ints each): per layer the key and value slot views'
    addresses ((S, Hkv, max_len, D) each, with the same strides) and those strides. A captured pass
    reads its cache through this table, so one graph serves every cache (each rollout and replay
    makes its own): the host copies the current cache's table into the bucket before a replay."""
    rows = []
    for keys, values in zip(key_slots, value_slots):
        if keys.shape != values.shape or keys.stride() != values.stride() or keys.dtype != values.dtype:
            raise ValueError("table_rows: a layer's key and value slots need one shape, stride and dtype")
        rows.append([keys.data_ptr(), values.data_ptr(), *keys.stride()])
    return rows


def _launch_write(k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, qpos: torch.Tensor, table: torch.Tensor,
                  count: torch.Tensor, layer: int) -> None:
    n, hkv, d = k.shape
    if n == 0:
        return
    _kernel(_interpreting(), _slot_write_kernel)[(n, hkv)](
        k, v, slot, qpos, table, count, layer, *k.stride(), *v.stride(), d, BLOCK_D=triton.next_power_of_2(d))


def _launch_attention(q: torch.Tensor, slot: torch.Tensor, qpos: torch.Tensor, table: torch.Tensor,
                      count: torch.Tensor, layer: int, scale: float, n_rep: int, block_n: int) -> torch.Tensor:
    n, hq, d = q.shape
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    if n == 0 or hq == 0:
        return out
    _kernel(_interpreting())[(n, hq)](
        q, q, q, slot, qpos, out, table, count, layer, float(scale),
        *q.stride(), 0, 0, 0, 0, 0, 0, 0, 0, *out.stride(), d, n_rep,
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d), CACHE_TABLE=True)
    return out


# As torch operators, so that anything recording a pass's operators (a CUDA graph's capture does not
# need it; `rltt.rollout.graph_emulation`, which emulates one on CPU, does) sees each launch as one
# operator on its tensors and can call it again. The cache they read and write is reached through
# ``table``, not passed as a tensor.
_write_op = torch.library.custom_op("rltt::slot_write", _launch_write, mutates_args=())
_attention_op = torch.library.custom_op("rltt::slot_attention_table", _launch_attention, mutates_args=())


def slot_write_table(k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, qpos: torch.Tensor, table: torch.Tensor,
                     count: torch.Tensor, layer: int) -> None:
    """Write item i's key and value (``k``, ``v`` (N, Hkv, D)) at position ``qpos[i]`` of slot ``slot[i]``
    of layer ``layer``'s cache (reached through ``table``, `table_rows`) for the items i < ``count[0]``;
    the others write nothing. One launch."""
    _write_op(k, v, slot, qpos, table, count, layer)


def slot_attention_table(q: torch.Tensor, slot: torch.Tensor, qpos: torch.Tensor, table: torch.Tensor,
                         count: torch.Tensor, layer: int, scale: float, n_rep: int,
                         block_n: int | None = None) -> torch.Tensor:
    """`slot_attention` over layer ``layer``'s cache reached through ``table`` (`table_rows`), for the
    items i < ``count[0]``; the others read nothing and get 0. The same kernel and arithmetic as
    `slot_attention`: an item's output is bitwise the same by either. ``n_rep``: query heads per key head."""
    if block_n is None:
        block_n = _block_n(q.device)
    return _attention_op(q, slot, qpos, table, count, layer, float(scale), n_rep, block_n)
