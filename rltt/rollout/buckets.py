"""Bucketed passes of the native engine: static item counts, captured as CUDA graphs on a GPU.

A pass runs the shared block over its N items (decode tokens and pending entries of its rows). Its
attention reads a KV cache whose layout changes every pass (key lengths, groups, slots); everything
else — the layers' norms, projections, RoPE, MLPs and the final norm — depends only on N. So the pass is cut at its attention calls (docs/engine.md, "Bucketed passes"):

- N is padded to a *bucket* (`BUCKETS`, the smallest entry >= N). Each bucket owns static buffers
  (`_Bucket`): the items' embeddings, carries, RoPE rows and steps, and the attention output. The
  padded items are inert: their attention output is 0, they write nothing (no KV cell, carry or
  gate: the pass's writes name the real items only), they are never sampled or recorded.
- The pieces between two attention calls (layer l's post-attention half and layer l+1's
  pre-attention half; the first starts at the injection, the last ends at the final norm) run
  over the bucket's rows. The exit gate runs on the real rows (its one-column GEMM's CPU kernel
  changes with the row count at any size). On CUDA each piece is captured once per bucket
  as a `torch.cuda.CUDAGraph` (all of them in one shared memory pool) and replayed; the attention
  (`GroupedAttend`, which writes the real items' keys and values) runs eagerly between replays on
  the real items. On CPU the same pieces run eagerly.
- With the Triton attention (`SlotAttend`, ``rollout.attention: triton``) the pass is not cut: on
  CUDA it is captured whole, one graph per bucket and step kind (`PassBuckets._whole`), its every
  layer's key/value write and slot-attention launch included (`StaticSlotAttend`). Before each
  replay the host copies the pass's inputs into the bucket's `SlotInputs` (each real item's cache
  slot and position, the count of real items, the cache's table of addresses and strides — a graph
  serves every rollout's and replay's cache); items at or past the count write no KV cell and read
  none, their attention output is 0.
- Every pass of 1 to 512 items is bucketed: the table starts at 1 and 2 (buckets of their own, so
  never padded) and pads 3 to 4, then 5-8 to 8 and so on. So on a GPU a batch-1 rollout and the
  last live rows of a chunk replay graphs too. Passes of more items than the largest bucket (long
  prefills) run unbucketed. A count equal to a bucket runs bucketed as it is; whether a count
  below its bucket may be padded is `PaddingCheck`'s: with CUDA every count may (the bucketed
  rollout need only equal its own bucketed replay, below). On CPU a count whose real rows padding
  would change runs unbucketed: a CPU GEMM computes a row with one of a few kernels depending on
  the batch's row count, so a batch padded across such a boundary would change its rows' bits.
  Where the boundaries lie depends on the CPU, the BLAS build, the thread count and the GEMM's
  shape (one development machine: 1, 2-3, >= 4 rows, so there 3 is not padded to 4; another,
  AVX-512 with AMX: 1, 2-5, >= 6 at K = 128, >= 16 at K = 512, and single counts such as 25 or 129
  in a tiny model's loop step). So on CPU this is measured, not assumed: `cpu_padding_check` runs
  the model's own loop step (every layer, LoRA and injection GEMM in it) at each padded count and
  at its bucket, and a count whose real rows change runs unpadded (tests/rollout/test_buckets.py
  checks the bucketed path against the unbucketed one bit for bit).

Exactness: the bucketed and the unbucketed pass compute the same values bit for bit on CPU (fp32
and bf16). On a GPU a wider GEMM may run another kernel, so there the bucketed rollout equals the
bucketed replay (both use the same buckets: `replay_logprobs` follows the engine that last sampled
with the model), which is what replay's exactness needs, not the unbucketed engine's bits (the
learner's ratio is anchored on the rollout's own log-probs either way).

What a graph reads by address: the bucket's buffers, the model's parameters and the fused q/k/v
copies (`rltt.model.layers.FusedWeights`). `PassBuckets.prepare` (every executor, so every
rollout and replay) refreshes the fused copies in place and drops the graphs when a parameter's
address changed (``load_state_dict(assign=True)``, ``.to()``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from rltt.errors import RlttError
from rltt.rollout.kv_cache import SlotInputs

#: item counts a pass is padded to (the smallest entry >= its items). It starts at 1: a batch-1
#: rollout's passes and the last live rows of every chunk run 1-3 items, and on a GPU those replay
#: graphs like any other pass; 1 and 2 are their own buckets (never padded), 3 pads to 4 where
#: `PaddingCheck` allows it (always with CUDA; on CPU as measured)
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def bucket_of(items: int, table: tuple[int, ...] = BUCKETS) -> int | None:
    """The bucket a pass of ``items`` items is padded to, or None (no items, or more than the table's
    largest bucket): run it unbucketed."""
    if items < 1 or items > table[-1]:
        return None
    for size in table:
        if size >= items:
            return size
    return None


#: what `cpu_padding_check` measured, per model configuration, dtype, thread count and table
_CHECKS: dict[tuple, "PaddingCheck"] = {}
#: item counts up to this are each checked; above it, each bucket's range by its edges and middle
DENSE_CHECK = 128
#: bytes an elementwise CPU kernel's vector loop handles at once (two 64-byte vectors on AVX-512)
#: and the elements below which it runs on one thread: a tensor's elements past the last whole
#: vector loop (its tail, and each thread's chunk's) are computed by scalar code, whose bits differ
#: from the vector body's for a few per cent of inputs (SiLU in fp32 on AVX-512: 4 %)
VECTOR_BYTES, GRAIN = 128, 32768


def _row_widths(config) -> set[int]:
    """The per-item widths of the tensors a loop step's elementwise kernels run over."""
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    inter = config.intermediate_size
    return {config.hidden_size, inter, 2 * inter, heads * dim, kv * dim, (heads + 2 * kv) * dim}


def tail_free(items: int, size: int, widths: set[int], itemsize: int, threads: int) -> bool:
    """Whether every elementwise kernel of a pass of ``items`` items padded to ``size`` computes the
    real items' elements in its vector body in both runs: each tensor's elements a whole number of
    vector loops, and so is each thread's chunk where the tensor is split among threads (an
    approximation of the CPU kernels' loop structure; `cpu_padding_check` measures the rest)."""
    for w in widths:
        for n in (items, size):
            numel = n * w
            chunks = min(threads, -(-numel // GRAIN)) if threads > 1 else 1
            if numel * itemsize % VECTOR_BYTES or (chunks > 1 and -(-numel // chunks) * itemsize % VECTOR_BYTES):
                return False
    return True


@dataclass(frozen=True)
class PaddingCheck:
    """Which item counts may be padded on this machine without changing a real row's bits: none
    whose elementwise kernels would meet a scalar tail (`tail_free` over ``widths``; no widths: no
    such rule, as with CUDA), and of the rest, counts up to `DENSE_CHECK` as measured one by one,
    larger ones by their bucket."""

    bad_counts: frozenset[int] = frozenset()  # counts <= DENSE_CHECK whose rows changed when padded
    bad_buckets: frozenset[int] = frozenset()  # buckets > DENSE_CHECK one of whose checked counts changed
    widths: frozenset[int] = frozenset()  # the step's per-item widths (`_row_widths`)
    itemsize: int = 4
    threads: int = 1

    def allows(self, items: int, size: int) -> bool:
        if not tail_free(items, size, self.widths, self.itemsize, self.threads):
            return False
        return items not in self.bad_counts if items <= DENSE_CHECK else size not in self.bad_buckets


def _checked_counts(table: tuple[int, ...]) -> list[int]:
    """Item counts `cpu_padding_check` pads: every count up to `DENSE_CHECK`, then each larger
    bucket's range by its two edges and middle (a count that is already a bucket is not padded)."""
    counts, prev = set(range(1, min(table[-1], DENSE_CHECK) + 1)), table[0]
    for b in table:
        if b > DENSE_CHECK:
            counts.update({prev + 1, (prev + b) // 2, b - 1})
        prev = b
    return sorted(n for n in counts if bucket_of(n, table) not in (None, n))


@torch.no_grad()
def cpu_padding_check(inner, config, dtype: torch.dtype, table: tuple[int, ...] = BUCKETS) -> PaddingCheck:
    """Which passes padding leaves bitwise unchanged on this CPU: the loop step (``inner.step``:
    injection, every layer's GEMMs, LoRA included, with the attention's output given, final norm)
    run at each checked count ``n`` and at its bucket, at step 1, a later step and per-item steps,
    with the same inputs in the first ``n`` rows; a count whose rows differ at any of them runs
    unpadded. Rows differ through a GEMM's kernel class, chosen by the row count (measured here,
    value-independent), or through an elementwise kernel's scalar tail, set by the tensor's size
    and hit only by some values (so not measured by one draw: `tail_free` rules those counts out by
    their sizes, and they are not checked here). Kernel choice depends on shapes, not values, so one
    draw of random inputs serves, and the result is cached per configuration, dtype, thread count and
    table (the caller's random state is not touched)."""
    key = (config.to_json_string(use_diff=False), dtype, torch.get_num_threads(), table)
    check = _CHECKS.get(key)
    if check is not None:
        return check
    gen = torch.Generator().manual_seed(0)
    rows, d, head_dim = table[-1], config.hidden_size, config.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    embeds, carry, cos, sin = rand(rows, 1, d), rand(rows, 1, d), rand(rows, 1, 1, head_dim), rand(rows, 1, 1, head_dim)
    attn = rand(rows, config.num_attention_heads, 1, head_dim)
    loops = config.num_loops
    kinds = [1] + ([2] if loops > 1 else []) + [torch.arange(rows) % loops + 1]
    tails = PaddingCheck(widths=frozenset(_row_widths(config)), itemsize=torch.empty(0, dtype=dtype).element_size(),
                         threads=torch.get_num_threads())
    bad: set[int] = set()
    for step in kinds:
        padded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def run(n):
            at = step if isinstance(step, int) else step[:n]
            return inner.step(embeds[:n], carry[:n], at, cos[:n], sin[:n], lambda q, k, v, layer: attn[:n])

        for n in _checked_counts(table):
            size = bucket_of(n, table)
            if n in bad or not tails.allows(n, size):
                continue
            if size not in padded:
                padded[size] = run(size)
            (h_n, c_n), (h_b, c_b) = run(n), padded[size]
            if not (torch.equal(h_n, h_b[:n]) and torch.equal(c_n, c_b[:n])):
                bad.add(n)
    check = _CHECKS[key] = replace(tails, bad_counts=frozenset(n for n in bad if n <= DENSE_CHECK),
                                   bad_buckets=frozenset(bucket_of(n, table) for n in bad if n > DENSE_CHECK))
    return check


def resolve_cuda_graphs(setting: bool | None, device: torch.device | str, key: str = "rollout.cuda_graphs") -> bool:
    """``rollout.cuda_graphs``: None is on with CUDA, off elsewhere; True needs a CUDA device."""
    cuda = torch.device(device).type == "cuda"
    if setting is None:
        return cuda
    if setting and not cuda:
        from rltt.config import recipe_error

        raise recipe_error(key, f"true needs a CUDA device, the model is on {torch.device(device).type}: "
                                f"use null or false")
    return bool(setting)


@dataclass
class _Captured:
    """One bucket's pass at one step kind, captured: L + 1 graphs (pieces between the attention calls),
    or one graph of the whole pass with the Triton attention, and the static tensors they read and write."""

    pieces: list
    h: torch.Tensor  # (S, 1, d)
    carry: torch.Tensor  # (S, 1, d)


@dataclass
class _Bucket:
    """The static buffers of one bucket of ``size`` items."""

    size: int
    embeds: torch.Tensor  # (S, 1, d) model dtype
    carry: torch.Tensor  # (S, 1, d)
    cos: torch.Tensor  # (S, 1, 1, D)
    sin: torch.Tensor  # (S, 1, 1, D)
    steps: torch.Tensor  # (S,) int64, 1 on padded items
    attn_out: torch.Tensor  # (S, Hq, 1, D), 0 on padded items
    q: torch.Tensor | None  # (S, Hq, 1, D): a captured piece's q/k/v, copied for the eager attention (CUDA)
    k: torch.Tensor | None  # (S, Hkv, 1, D)
    v: torch.Tensor | None
    graphs: dict = field(default_factory=dict)  # step kind -> _Captured; (WHOLE, step kind) -> a whole pass
    slot_inputs: SlotInputs | None = None  # a captured Triton pass's per-pass inputs (made at its first capture)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, self.carry, self.cos, self.sin, self.steps,
                                                          self.attn_out, self.q, self.k, self.v) if t is not None) + (
            self.slot_inputs.nbytes() if self.slot_inputs is not None else 0)


#: the graphs key of a whole captured pass (the Triton attention): ``(WHOLE, step kind)``
WHOLE = "whole"


class PassBuckets:
    """The bucketed passes of one model on its device (shared by every executor of that model:
    rollouts and replays). ``capture``: CUDA graphs (CUDA only); else the same pieces run eagerly.
    ``graphs``: the capture backend (default `CudaGraphs`; tests pass a CPU emulation of its
    semantics, rltt/rollout/graph_emulation.py)."""

    def __init__(self, model, capture: bool, table: tuple[int, ...] = BUCKETS, graphs=None):
        param = model.lm_head.weight
        if capture and graphs is None and param.device.type != "cuda":
            raise RlttError("PassBuckets: CUDA graphs need the model on a CUDA device")
        cfg = model.config
        self.inner = model.model
        self.capture, self.table = capture, tuple(table)
        self.dtype, self.device = param.dtype, param.device
        self.hidden, self.head_dim = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        # int steps > 1 run one graph unless a per-loop LoRA picks its adapters by the step's value
        # (a shared adapter is the same at every step)
        self.stepwise = any(getattr(m, "lora_rank", 0) and getattr(m, "lora_per_loop", True) for m in model.modules())
        self.buckets: dict[int, _Bucket] = {}
        self.signature: tuple | None = None
        self.graphs = graphs if graphs is not None else (CudaGraphs(self.device) if capture else None)
        # on CPU, the item counts padding would change (`cpu_padding_check`, made at the first pass and
        # again when the thread count changes);
        # with CUDA none is excluded: there the bucketed rollout need only equal its own replay
        self.check: PaddingCheck | None = PaddingCheck() if self.device.type == "cuda" else None
        self.replays = 0  # passes served by replaying captured graphs
        self.eager = 0  # bucketed passes run eagerly (CPU, or a capture's first pass)
        self.captures = 0  # (bucket, step kind) passes captured: L + 1 graphs each, one with the Triton attention

    # -- buffers --------------------------------------------------------------------------------
    def size_of(self, items: int) -> int | None:
        size = bucket_of(items, self.table)
        if size is None or size == items:
            return size
        if self.check is None or (self.device.type == "cpu" and self.check.threads != torch.get_num_threads()):
            self.check = cpu_padding_check(self.inner, self.inner.config, self.dtype, self.table)  # cached per threads
        return size if self.check.allows(items, size) else None

    def bucket(self, size: int) -> _Bucket:
        b = self.buckets.get(size)
        if b is None:
            d, D, dev, dt = self.hidden, self.head_dim, self.device, self.dtype
            qkv = [torch.zeros(size, h, 1, D, dtype=dt, device=dev)
                   for h in (self.num_heads, self.num_kv_heads, self.num_kv_heads)] if self.capture else [None] * 3
            b = _Bucket(size, torch.zeros(size, 1, d, dtype=dt, device=dev), torch.zeros(size, 1, d, dtype=dt, device=dev),
                        torch.zeros(size, 1, 1, D, dtype=dt, device=dev), torch.zeros(size, 1, 1, D, dtype=dt, device=dev),
                        torch.ones(size, dtype=torch.long, device=dev),
                        torch.zeros(size, self.num_heads, 1, D, dtype=dt, device=dev), *qkv)
            self.buckets[size] = b
        return b

    def nbytes(self) -> int:
        """Bytes of the buckets' static buffers made so far (the memory plan's ``bucket_buffers``)."""
        return sum(b.nbytes() for b in self.buckets.values())

    def prepare(self) -> None:
        """Before a rollout's or a replay's passes: the fused q/k/v copies refreshed in place (a graph
        runs no Python check), and the graphs dropped if a parameter moved to another address."""
        for layer in self.inner.layers:
            layer.self_attn.fused_weights()  # rebuilds in place when the weights changed
        if not self.capture:
            return
        signature = tuple(p.data_ptr() for p in self.inner.parameters()) + tuple(
            layer.self_attn.fused_qkv.weight.data_ptr() if layer.self_attn.fused_qkv.weight is not None else 0
            for layer in self.inner.layers)
        if signature != self.signature:
            for b in self.buckets.values():
                b.graphs.clear()
            self.signature = signature

    # -- a pass ---------------------------------------------------------------------------------
    def step(self, size: int, embeds: torch.Tensor, carry: torch.Tensor, step, cos: torch.Tensor,
             sin: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """`LoopedModel.step` over ``n`` items (embeds, carry (n, d); cos, sin (n, 1, 1, D); ``step`` an
        int or (n,) steps), padded to ``size``: returns h (n, 1, d) and carry (n, d), views of the
        bucket's static outputs, valid until the next bucketed pass. (The exit gate, a GEMM of one
        output column, is left to the caller on the n real rows: its CPU kernel changes with the
        batch's rows at any size.)"""
        n = embeds.shape[0]
        b = self.bucket(size)
        b.embeds[:n, 0].copy_(embeds)
        first = isinstance(step, int) and step == 1  # z_1 = e: the carry is not read
        if not first:
            b.carry[:n, 0].copy_(carry)
        b.cos[:n].copy_(cos)
        b.sin[:n].copy_(sin)
        if isinstance(step, int):
            kind = step if (first or self.stepwise) else 0
            step_arg = step
        else:
            b.steps[:n].copy_(step)
            kind, step_arg = -1, b.steps
        if not self.capture:
            self.eager += 1
            h, carry = self._forward(b, step_arg, self._eager_attention(b, n, attend))
            return h[:n], carry[:n, 0]
        if hasattr(attend, "static"):  # the Triton attention (`SlotAttend`): the pass is one graph
            return self._whole(b, n, kind, step_arg, attend)
        captured = b.graphs.get(kind)
        if captured is None:
            captured = b.graphs[kind] = self._captured(size, lambda: self._capture(b, step_arg))
        pieces = captured.pieces
        q, k, v, out = b.q[:n], b.k[:n], b.v[:n], b.attn_out[:n]  # the real items' rows, every layer's
        for layer, piece in enumerate(pieces[:-1]):
            piece.replay()
            out.copy_(attend(q, k, v, layer))
        pieces[-1].replay()
        self.replays += 1
        return captured.h[:n], captured.carry[:n, 0]

    def _captured(self, size: int, capture) -> _Captured:
        try:
            captured = capture()
        except Exception as e:  # an operator the graphs cannot hold: say which switch avoids them
            raise RlttError(f"CUDA-graph capture of a {size}-item pass failed ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]}); rollout.cuda_graphs: false runs the passes "
                            f"without graphs") from e
        self.captures += 1
        return captured

    def _whole(self, b: _Bucket, n: int, kind, step_arg, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """A pass with the Triton attention, replayed as ONE graph: its per-pass inputs (each real item's
        cache slot and position, the count of real items, the cache's table) copied into the bucket's
        `SlotInputs`, then the graph — every layer's key/value writes and slot attention included
        (`StaticSlotAttend`: padded items write nothing and read nothing) — replayed."""
        if b.slot_inputs is None:
            b.slot_inputs = SlotInputs(b.size, len(self.inner.layers), self.device)
        attend.load(b.slot_inputs, n)
        captured = b.graphs.get((WHOLE, kind))
        if captured is None:
            static = attend.static(b.slot_inputs)
            captured = self._captured(b.size, lambda: self._capture_whole(b, step_arg, static))
            b.graphs[(WHOLE, kind)] = captured
        captured.pieces[0].replay()
        self.replays += 1
        return captured.h[:n], captured.carry[:n, 0]

    def _capture_whole(self, b: _Bucket, step_arg, static) -> _Captured:
        """Capture the whole pass with ``static`` (`StaticSlotAttend`) as its attention: a warm-up run
        outside the capture (compiles the kernels; it writes the real items' keys and values, the
        same bits the pass writes), then the pass in one graph."""
        open_graph = [self.graphs.graph()]
        h, carry = self._record(b, step_arg, open_graph, warm=static, hook=static)
        return _Captured(open_graph, h, carry)

    def _record(self, b: _Bucket, step_arg, open_graph: list, warm, hook):
        """The capture protocol both kinds share: a warm-up pass with ``warm`` as its attention
        (kernels and library handles made outside the capture), then the pass with ``hook``, recorded
        into ``open_graph[0]`` (a hook may end it and put the next one there). Ends the graph open at
        the pass's end; returns the pass's static outputs."""
        graphs = self.graphs
        with graphs.capturing():
            self._forward(b, step_arg, warm)
            graphs.warmed()
            graphs.begin(open_graph[0])
            try:
                h, carry = self._forward(b, step_arg, hook)
            except BaseException:
                graphs.end(open_graph[0])  # leave the stream out of capture mode
                raise
            graphs.end(open_graph[0])
        return h, carry

    def _forward(self, b: _Bucket, step_arg, hook):
        return self.inner.step(b.embeds, b.carry, step_arg, b.cos, b.sin, hook)

    @staticmethod
    def _eager_attention(b: _Bucket, n: int, attend):
        def hook(q, k, v, layer):
            b.attn_out[:n].copy_(attend(q[:n], k[:n], v[:n], layer))
            return b.attn_out
        return hook

    def _capture(self, b: _Bucket, step_arg) -> _Captured:
        """Capture the bucket's pieces: a warm-up run (attention skipped: nothing is written), then the
        pass with a hook that ends a piece at each attention call, copying its q/k/v into the bucket's
        buffers inside the piece, and starts the next one reading ``attn_out``."""
        graphs = self.graphs
        pieces = []
        open_graph = [graphs.graph()]

        def skip(q, k, v, layer):
            return b.attn_out

        def cut(q, k, v, layer):
            b.q.copy_(q)
            b.k.copy_(k)
            b.v.copy_(v)
            graphs.end(open_graph[0])
            pieces.append(open_graph[0])
            open_graph[0] = graphs.graph()
            graphs.begin(open_graph[0])
            return b.attn_out

        h, carry = self._record(b, step_arg, open_graph, warm=skip, hook=cut)
        pieces.append(open_graph[0])
        return _Captured(pieces, h, carry)


class CudaGraphs:
    """`torch.cuda.CUDAGraph` capture: every piece in one shared memory pool, captured on a side
    stream (as `torch.cuda.graph` does), replayed on the current stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)

    def graph(self):
        return torch.cuda.CUDAGraph()

    def begin(self, graph) -> None:
        graph.capture_begin(pool=self.pool)

    def end(self, graph) -> None:
        graph.capture_end()

    def warmed(self) -> None:
        self.stream.synchronize()

    @contextmanager
    def capturing(self):
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)


def pass_buckets(model, cuda_graphs: bool | None, buckets: bool | None = None) -> PassBuckets | None:
    """A `NativeEngine`'s bucketed passes: ``cuda_graphs`` resolved for the model's device
    (`resolve_cuda_graphs`); ``buckets`` None follows it, True without graphs runs them eagerly."""
    capture = resolve_cuda_graphs(cuda_graphs, model.lm_head.weight.device)
    if buckets is False and capture:
        raise RlttError("NativeEngine: cuda_graphs=True needs buckets (capture pads passes to bucket sizes)")
    if not (capture or buckets):
        return None
    return PassBuckets(model, capture=capture)
