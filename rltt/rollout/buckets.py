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
- Passes of fewer than `SMALLEST` items, or more than the table's largest bucket, run unbucketed
  (today's code). Why four: a CPU fp32 GEMM computes a row with one of three kernels depending on
  the batch's row count (1, 2–3, >= 4), so a batch padded from 3 rows to 4 would change its rows'
  bits; from 4 rows up, padding does not (tests/rollout/test_buckets.py checks the bucketed path
  against the unbucketed one bit for bit).

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

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rltt.errors import RlttError

#: item counts a pass is padded to (the smallest entry >= its items)
BUCKETS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
#: passes of fewer items run unbucketed: the CPU fp32 GEMM kernel class of a batch of 1-3 rows
SMALLEST = 4


def bucket_of(items: int, table: tuple[int, ...] = BUCKETS) -> int | None:
    """The bucket a pass of ``items`` items is padded to, or None: run it unbucketed."""
    if items < SMALLEST or items > table[-1]:
        return None
    for size in table:
        if size >= items:
            return size
    return None


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
    """One bucket's pass at one step kind, captured: L + 1 graphs (pieces between the attention calls)
    and the static tensors they read and write."""

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
    graphs: dict = field(default_factory=dict)  # step kind -> _Captured

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embeds, self.carry, self.cos, self.sin, self.steps,
                                                          self.attn_out, self.q, self.k, self.v) if t is not None)


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
        # int steps > 1 run one graph unless a step-wise LoRA picks its adapters by the step's value
        self.stepwise = any(getattr(m, "lora_rank", 0) for m in model.modules())
        self.buckets: dict[int, _Bucket] = {}
        self.signature: tuple | None = None
        self.graphs = graphs if graphs is not None else (CudaGraphs(self.device) if capture else None)
        self.replays = 0  # passes served by replaying captured graphs
        self.eager = 0  # bucketed passes run eagerly (CPU, or a capture's first pass)
        self.captures = 0  # (bucket, step kind) passes captured: L + 1 graphs each

    # -- buffers --------------------------------------------------------------------------------
    def size_of(self, items: int) -> int | None:
        return bucket_of(items, self.table)

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
        captured = b.graphs.get(kind)
        if captured is None:
            try:
                captured = b.graphs[kind] = self._capture(b, step_arg)
                self.captures += 1
            except Exception as e:  # an operator the graphs cannot hold: say which switch avoids them
                raise RlttError(f"CUDA-graph capture of a {size}-item pass failed ({type(e).__name__}: "
                                f"{' '.join(str(e).split())[:200]}); rollout.cuda_graphs: false runs the passes "
                                f"without graphs") from e
        pieces = captured.pieces
        q, k, v, out = b.q[:n], b.k[:n], b.v[:n], b.attn_out[:n]  # the real items' rows, every layer's
        for layer, piece in enumerate(pieces[:-1]):
            piece.replay()
            out.copy_(attend(q, k, v, layer))
        pieces[-1].replay()
        self.replays += 1
        return captured.h[:n], captured.carry[:n, 0]

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
        graph = graphs.graph()

        def skip(q, k, v, layer):
            return b.attn_out

        def cut(q, k, v, layer):
            nonlocal graph
            b.q.copy_(q)
            b.k.copy_(k)
            b.v.copy_(v)
            graphs.end(graph)
            pieces.append(graph)
            graph = graphs.graph()
            graphs.begin(graph)
            return b.attn_out

        with graphs.capturing():
            self._forward(b, step_arg, skip)  # warm-up: kernels and library handles made outside capture
            graphs.warmed()
            graphs.begin(graph)
            try:
                h, carry = self._forward(b, step_arg, cut)
            except BaseException:
                graphs.end(graph)  # leave the stream out of capture mode
                raise
            graphs.end(graph)
            pieces.append(graph)
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


_ATTACHED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def attach(model, buckets: PassBuckets | None) -> None:
    """The bucketed passes the engine using ``model`` runs (None: unbucketed): `replay_logprobs`
    follows them, so a replay re-executes the passes as they ran."""
    if buckets is None:
        _ATTACHED.pop(model, None)
    else:
        _ATTACHED[model] = buckets


def attached(model) -> PassBuckets | None:
    return _ATTACHED.get(model)


def pass_buckets(model, cuda_graphs: bool | None, buckets: bool | None = None) -> PassBuckets | None:
    """A `NativeEngine`'s bucketed passes: ``cuda_graphs`` resolved for the model's device
    (`resolve_cuda_graphs`); ``buckets`` None follows it, True without graphs runs them eagerly."""
    capture = resolve_cuda_graphs(cuda_graphs, model.lm_head.weight.device)
    if buckets is False and capture:
        raise RlttError("NativeEngine: cuda_graphs=True needs buckets (capture pads passes to bucket sizes)")
    if not (capture or buckets):
        return None
    return PassBuckets(model, capture=capture)
