"""`PassExecutor`: run one serial pass of the shared block over a list of work items.

A pass is a pure function of its plan — ``(row, start, end, step)`` ranges sorted by
(step, row) — and of the state earlier passes left (KV cache, per-token carries, tokens).
The engine and `replay_logprobs` both drive this class, so re-executing a recorded schedule
performs the same floating-point operations on the same operands: replay is bitwise.

Per item (row r, position p, step t) a pass runs the model's one loop step,
`LoopedModel.step` — ``z = inject(e_p, carry_p, t)``, the L shared layers (writing K/V slot
(t, l) at position p), ``h = norm_f(s)``, ``carry_p ← carry`` — batched over the items, then
``λ_t = gate(h)``. The carry of a token is the state of the deepest step computed for it,
which is exactly what its next step needs (steps of a token are computed in order).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rltt.model.modeling import LoopedForCausalLM
from rltt.rollout.attention import PassSetup
from rltt.rollout.kv_cache import (GroupedAttend, SlotGroup, StepKVCache, layout_groups, upload,
                                   without_cudnn_attention)


@dataclass
class _PassPlan:
    """What a pass needs that depends only on its ranges (and, for the groups, its step). Tokens at
    positions ≤ a range's end never change, so the embeddings can be reused too."""

    key: tuple
    uniform: bool  # every range at the same step
    step: int
    last: torch.Tensor
    item_steps: torch.Tensor
    embeds: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    groups: list[SlotGroup]
    write_rows: torch.Tensor  # where the items' keys/values go (`GroupedAttend.write_rows_of`)
    carry_rows: torch.Tensor  # the items' rows of ``carry`` viewed as (R·max_len, d)
    gate_cells: torch.Tensor  # the items' cells of ``gates`` viewed flat (T·R·max_len,)
    decode_cells: torch.Tensor  # each range's end (its decode token) in ``gates[t]`` viewed flat (R·max_len,)
    # the items' cache slots ((step − 1)·R + row) and positions, for an attention that reads slots per
    # item (`rltt.rollout.attention`, not ``grouped``); None with the grouped SDPA attention
    item_slots: torch.Tensor | None = None
    item_pos: torch.Tensor | None = None

    def restep(self, step: int, cache: StepKVCache) -> None:
        """The same ranges at another (uniform) step: move the cache slots the groups read and write."""
        if step == self.step:
            return
        _, num_cache_rows, heads, max_len, _ = cache.keys[0].shape
        shift = (step - self.step) * num_cache_rows
        self.groups = [replace(g, slots=g.slots + shift, step_view=None if g.step_view is None else step)
                       for g in self.groups]
        self.item_steps = torch.full_like(self.item_steps, step)
        self.write_rows = self.write_rows + shift * heads * max_len
        if self.item_slots is not None:
            self.item_slots = self.item_slots + shift
        self.gate_cells = self.gate_cells + shift * max_len
        self.step = step


class PassExecutor:
    """State of a batch of ``num_rows`` sequences and the pass function over it.

    - ``tokens`` (R, max_len) int64: prompt + sampled tokens per row (positions from 0).
    - ``carry`` (R, max_len, d) model dtype: each token's carried state.
    - ``gates`` (T, R, max_len) fp32: λ_t of every computed entry, NaN elsewhere.

    ``setup``: how its passes run (`rltt.rollout.attention.PassSetup`: the attention implementation,
    ``sdpa`` or ``triton``, and the engine's CUDA-graph buckets); None: the default attention,
    unbucketed. A replay uses the rollout's attention (`Schedule.attention`) and the engine's buckets.
    """

    def __init__(self, model: LoopedForCausalLM, num_rows: int, max_len: int, setup: PassSetup | None = None):
        cfg = model.config
        param = model.lm_head.weight
        self.model, self.inner = model, model.model
        self.dtype, self.device = param.dtype, param.device
        self.num_rows, self.max_len = num_rows, max_len
        self.num_loops = cfg.num_loops
        self.n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scale = cfg.head_dim**-0.5
        setup = setup if setup is not None else PassSetup.of(device=self.device)
        self.setup = setup
        self.attention = setup.attention.name  # what a `Schedule` records
        self._attention = setup.attention
        self.cache = StepKVCache(cfg.num_hidden_layers, cfg.num_loops, num_rows, cfg.num_key_value_heads,
                                 max_len, cfg.head_dim, self.dtype, self.device)
        self.tokens = torch.zeros(num_rows, max_len, dtype=torch.long, device=self.device)
        self.carry = torch.zeros(num_rows, max_len, cfg.hidden_size, dtype=self.dtype, device=self.device)
        self.gates = torch.full((cfg.num_loops, num_rows, max_len), float("nan"), device=self.device)
        positions = torch.arange(max_len, device=self.device)[:, None]
        self.cos, self.sin = self.inner.rotary_emb(positions, self.dtype)  # (max_len, 1, D), once
        self._plan: _PassPlan | None = None
        self._ran: _PassPlan | None = None  # the last pass's plan
        # the engine's bucketed passes (`rltt.rollout.buckets`; a replay given them runs its passes as
        # they ran); None: every pass unpadded
        self.buckets = setup.buckets
        if self.buckets is not None:
            self.buckets.prepare()

    @torch.inference_mode()
    def run(self, rows: list[int], starts: list[int], ends: list[int], steps: list[int]):
        """Execute one pass. Returns ``(h (N, d), gates (N,) fp32, last (n,))`` where items are
        ordered as the ranges and ``last[i]`` is the item index of range i's ``end`` position.
        Its attention runs without SDPA's cuDNN backend (`without_cudnn_attention`).

        The pass runs in inference mode: the same arithmetic as under ``no_grad``, with less host
        work per operator (no version counters or autograd metadata on the tensors it makes; a
        quickstart rollout on CPU took 0.93× the time, bench/RESULTS.md). What it makes is therefore an
        inference tensor: read outside (``h``, ``gates``), written in place only by passes; the
        executor's state (cache, carries, gates, tokens) is made outside and stays a normal tensor."""
        with without_cudnn_attention():
            return self._run(rows, starts, ends, steps)

    def _run(self, rows: list[int], starts: list[int], ends: list[int], steps: list[int]):
        plan = self._plan_for(rows, starts, ends, steps)
        self._ran = plan
        embeds = plan.embeds
        step = steps[0] if plan.uniform else plan.item_steps  # an int keeps LoRA on its batched path
        carry_flat = self.carry.view(-1, self.carry.shape[-1])
        # step 1 reads no carry (z_1 = e): skip the gather
        carry = embeds if plan.uniform and steps[0] == 1 else carry_flat.index_select(0, plan.carry_rows)
        attend = self._attention.attend(self.cache, plan, self.scale)
        size = None if self.buckets is None else self.buckets.size_of(embeds.shape[0])
        if size is not None:  # padded to a bucket's static shape (replayed as CUDA graphs on a GPU)
            h, carry = self.buckets.step(size, embeds, carry, step, plan.cos, plan.sin, attend)
        else:  # the items are the batch axis, one position each: (N, 1, d)
            h, carry = self.inner.step(embeds[:, None], carry[:, None], step, plan.cos, plan.sin, attend)
            carry = carry[:, 0]
        gates = self.inner.gate(h)[:, 0]
        carry_flat.index_copy_(0, plan.carry_rows, carry)
        self.gates.view(-1).index_copy_(0, plan.gate_cells, gates)
        return h[:, 0], gates, plan.last

    def _plan_for(self, rows: list[int], starts: list[int], ends: list[int], steps: list[int]) -> "_PassPlan":
        """The pass's items, embeddings, RoPE tables and attention groups. A dense token's T passes
        repeat the same ranges one step deeper: the previous plan is reused, re-stepped."""
        uniform = all(s == steps[0] for s in steps)
        key = (tuple(rows), tuple(starts), tuple(ends))
        cached = self._plan
        if uniform and cached is not None and cached.key == key:
            cached.restep(steps[0], self.cache)
            return cached
        device = self.device
        sizes = [e - s + 1 for s, e in zip(starts, ends)]
        n_items = sum(sizes)  # known on the host: no sync
        grouped = self._attention.grouped
        layouts = layout_groups(rows, starts, ends, steps, self.num_rows) if grouped else []
        # every index list of the plan in one upload; the rest is derived on the device
        views = upload([rows, steps, ends, starts, sizes] + [x for g in layouts for x in g.lists()], device)
        rows_t, steps_t, ends_t, starts_t, counts = views[:5]
        last = torch.cumsum(counts, 0) - 1
        if n_items == len(rows):
            item_rows, item_steps, item_pos = rows_t, steps_t, ends_t
        else:
            owner = torch.repeat_interleave(torch.arange(len(rows), device=device), counts, output_size=n_items)
            item_rows, item_steps = rows_t[owner], steps_t[owner]
            item_pos = torch.arange(n_items, device=device) - (last - counts + 1)[owner] + starts_t[owner]
        groups, at = [], 5
        for g in layouts:
            k = len(g.lists())
            groups.append(g.build(views[at: at + k], self.num_rows, self.n_rep, self.dtype))
            at += k
        plan = _PassPlan(
            key=key, uniform=uniform, step=steps[0], last=last, item_steps=item_steps,
            embeds=self.inner.embed_tokens(self.tokens[item_rows, item_pos]),
            cos=self.cos[item_pos], sin=self.sin[item_pos], groups=groups,
            write_rows=GroupedAttend.write_rows_of(self.cache, item_rows, item_pos, item_steps),
            carry_rows=item_rows * self.max_len + item_pos,
            gate_cells=((item_steps - 1) * self.num_rows + item_rows) * self.max_len + item_pos,
            decode_cells=rows_t * self.max_len + ends_t)
        if not grouped:
            plan.item_slots, plan.item_pos = (item_steps - 1) * self.num_rows + item_rows, item_pos
        self._plan = plan if uniform else None
        return plan

    def decode_gates(self) -> torch.Tensor:
        """(T, n) on the device: λ_1..λ_T of the decode token (each range's end) of the last pass's n
        ranges (NaN at steps not computed)."""
        return self.gates.view(self.num_loops, -1).index_select(1, self._ran.decode_cells)

    def write_tokens(self, cells: torch.Tensor, tokens: torch.Tensor) -> None:
        """``tokens.view(-1)[cells[i]] = tokens[i]`` (cell ``row · max_len + position``), one ``index_copy_``."""
        self.tokens.view(-1).index_copy_(0, cells, tokens)

    @torch.no_grad()
    def fork(self, pairs: list[list[int]]) -> None:
        """Copy the computed state of positions ``0..length-1`` (every step) from row ``src`` to
        row ``dst`` for each ``[src, dst, length]``: the rows of one prompt share its prefill."""
        by_source: dict[tuple[int, int], list[int]] = {}
        for src, dst, length in pairs:
            by_source.setdefault((src, length), []).append(dst)
        for (src, n), dsts in by_source.items():
            dst = torch.tensor(dsts, device=self.device)
            for keys, values in zip(self.cache.keys, self.cache.values):
                keys[:, dst, :, :n] = keys[:, src: src + 1, :, :n]
                values[:, dst, :, :n] = values[:, src: src + 1, :, :n]
            self.carry[dst, :n] = self.carry[src: src + 1, :n]
            self.gates[:, dst, :n] = self.gates[:, src: src + 1, :n]

    @torch.no_grad()
    def admit(self, slot: int, tokens: list[int], src: int, length: int) -> None:
        """Slot ``slot`` starts holding a new row (continuous batching): with ``src ≥ 0`` the computed
        state of positions ``0..length-1`` comes from slot ``src`` (kept in place when ``src`` is
        ``slot``); its ``tokens`` written from position 0 and its gates from ``length`` on (0 without a
        source) reset to NaN. Entries a finished row left at later positions are never read: a pass
        reads only entries of a row's own earlier positions, which it has computed."""
        if src >= 0 and src != slot:
            self.fork([[src, slot, length]])
        self.tokens[slot, : len(tokens)] = torch.tensor(tokens, device=self.device)
        self.gates[:, slot, (length if src >= 0 else 0):] = float("nan")

    @torch.no_grad()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary fp32 logits of the exit states ``h`` (k, d) (the sampler needs them)."""
        return self.model.lm_head(h).float()
