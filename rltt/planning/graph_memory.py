"""Device bytes of the native engine's bucketed passes (`rltt.rollout.buckets`), per bucket.

With S items in a bucket, d the hidden size, q = heads·D, kv = kv_heads·D, f the MLP width and b
the engine dtype's bytes, a bucket's static buffers are::

    bucket_buffers  S·(2·d·b + 2·D·b + 8 + q·b)          embeddings, carries, RoPE cos/sin, steps (int64),
                                                        attention output
                    + S·(q + 2·kv)·b with CUDA graphs    the captured pieces' q/k/v for the eager attention
                    + 16·S + 8 + 48·L                   with CUDA graphs and rollout.attention triton: a
                                                        captured pass's inputs (`SlotInputs`: each item's
                                                        slot and position, the count of real items, the
                                                        cache table, L rows of 6 int64)

(`bucket_buffer_bytes`; tests/rollout/test_buckets.py and tests/rollout/test_triton_capture.py
measure them on CPU). With CUDA graphs every bucket also captures up to K graphs of L + 1 pieces
(one graph of the whole pass with the Triton attention) — K step kinds: the first step, later
uniform steps and mixed steps (3), or 1 + T + 1 with a step-wise LoRA — in one shared memory pool
that keeps each capture's outputs (h and the carry, 2·S·d·b) and the largest bucket's
intermediates of one piece (a whole pass's intermediates are freed and reused within its graph as a
piece's are, its attention outputs included; the same bound is used for it, not measured)::

    graph_pool      Σ_S K·2·S·d·b + S_max·(8·d + 3·q + 4·kv + 4·f)·b

An upper bound from the ops of a piece (two norms, q/k/v, RoPE, o_proj, the SwiGLU MLP, residual
adds). The captures add one fixed cost outside the pool: they run on their own side stream
(`rltt.rollout.buckets.CudaGraphs`), and PyTorch gives each (cuBLAS handle, stream) that runs a GEMM
its own cuBLAS workspace, allocated through the caching allocator at the stream's first GEMM and
kept while the process lives (PyTorch's aten/src/ATen/cuda/CublasHandlePool.cpp: 32 MiB by default
on Hopper, sm90; 8 MiB + 128 KiB on other GPUs; ``CUBLAS_WORKSPACE_CONFIG`` sets it). The plan
counts the larger default, once per engine::

    capture_workspace   32 MiB

Measured once (bench/gpu_check's rollouts section, bench/gpu_runs/2026-12-04b: the growth of
``memory_reserved`` from before the engine was made to after its graphs' rollouts and replay, the
cache emptied at both ends; an H200, torch 2.11 + CUDA 13, a random LoopLM of Ouro-1.4B's shape in
bf16): 80 MiB in each of two runs whose buckets differed (8-256 and 4-384), where buffers and pool
alone planned 67.5 and 98.9 MiB, the first an under-count. With the workspace the plan is 99.5 and
130.9 MiB, above both. That the workspace is 32 of those 80 MiB is read from PyTorch's source, not
measured apart; the other 48 MiB are within what buffers and pool planned in both runs, so no
rounding to the allocator's 2 MiB blocks or 20 MiB segments is added.
"""

from __future__ import annotations

from typing import Iterable

from rltt.planning.shapes import ModelShape
from rltt.rollout.attention import DEFAULT_ATTENTION


#: a bucket's bytes of per-pass inputs for a captured pass, by ``rollout.attention``: the Triton
#: attention's `rltt.rollout.kv_cache.SlotInputs` (slots and positions, S int64 each; the count; the
#: cache table, L × 6 int64); sdpa keeps none (its attention runs eagerly between the graphs)
CAPTURED_INPUTS = {"sdpa": lambda shape, size: 0, "triton": lambda shape, size: 16 * size + 8 + 48 * shape.layers}


def bucket_buffer_bytes(shape: ModelShape, dtype_bytes: int, sizes: Iterable[int], capture: bool,
                        attention: str = DEFAULT_ATTENTION) -> int:
    """Static buffers of the buckets ``sizes`` (`rltt.rollout.buckets._Bucket`)."""
    sizes = list(sizes)
    d, D, q, kv = shape.hidden, shape.head_dim, shape.q_dim, shape.kv_heads * shape.head_dim
    per_item = 2 * d * dtype_bytes + 2 * D * dtype_bytes + 8 + q * dtype_bytes
    inputs = 0
    if capture:
        per_item += (q + 2 * kv) * dtype_bytes
        inputs = sum(CAPTURED_INPUTS[attention](shape, size) for size in sizes)
    return sum(sizes) * per_item + inputs


def step_kinds(shape: ModelShape) -> int:
    """Graphs captured per bucket at most (`rltt.rollout.buckets.PassBuckets.step`'s kinds)."""
    return shape.loops + 2 if shape.lora_rank else 3


def graph_pool_bytes(shape: ModelShape, dtype_bytes: int, sizes: Iterable[int]) -> int:
    """Upper bound of the CUDA graphs' shared pool for the buckets ``sizes`` (module docstring)."""
    sizes = list(sizes)
    if not sizes:
        return 0
    d, q, kv, f = shape.hidden, shape.q_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    outputs = step_kinds(shape) * 2 * d * dtype_bytes * sum(sizes)
    return outputs + max(sizes) * (8 * d + 3 * q + 4 * kv + 4 * f) * dtype_bytes


#: the cuBLAS workspace of the captures' side stream (module docstring): PyTorch's default on Hopper,
#: the larger of its two CUDA defaults
CAPTURE_WORKSPACE = 32 * 2**20


def engine_graphs_bytes(shape: ModelShape, dtype_bytes: int, capture: bool, sizes: Iterable[int] | None = None,
                        attention: str = DEFAULT_ATTENTION) -> int:
    """What the bucketed passes keep on the device between rollouts: every bucket of the table (a pass's
    items are not known in advance) — buffers, plus with ``capture`` the graph pool and the capture
    stream's cuBLAS workspace."""
    from rltt.rollout.buckets import BUCKETS

    sizes = list(BUCKETS if sizes is None else sizes)
    return bucket_buffer_bytes(shape, dtype_bytes, sizes, capture, attention) + (
        graph_pool_bytes(shape, dtype_bytes, sizes) + CAPTURE_WORKSPACE if capture else 0)
