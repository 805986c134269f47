"""The plan's bytes for the native engine's bucketed passes (rltt.planning.graph_memory): every bucket of
the table, the smallest ones included; the capture stream's cuBLAS workspace; and not below what one
H200 reserved (bench/gpu_runs/2026-12-04b, bench/gpu_check.py's rollouts section)."""

import pytest

from rltt.planning.graph_memory import (CAPTURE_WORKSPACE, bucket_buffer_bytes, engine_graphs_bytes,
                                        graph_pool_bytes, step_kinds)
from rltt.planning.shapes import model_shape
from rltt.rollout.buckets import BUCKETS
from tests.planning.helpers import OURO_1_4B

MIB = 2**20


def test_every_bucket_of_the_table_is_counted():
    shape = model_shape(OURO_1_4B)
    assert engine_graphs_bytes(shape, 2, capture=False) == bucket_buffer_bytes(shape, 2, BUCKETS, capture=False)
    assert engine_graphs_bytes(shape, 2, capture=True) == (bucket_buffer_bytes(shape, 2, BUCKETS, capture=True)
                                                           + graph_pool_bytes(shape, 2, BUCKETS) + CAPTURE_WORKSPACE)
    # the 1- and 2-item buckets: their buffers and each step kind's captured outputs (h, carry) of 3 items
    larger = [b for b in BUCKETS if b > 2]
    assert BUCKETS[:2] == (1, 2)
    assert (engine_graphs_bytes(shape, 2, capture=True) - engine_graphs_bytes(shape, 2, capture=True, sizes=larger)
            == bucket_buffer_bytes(shape, 2, (1, 2), capture=True) + step_kinds(shape) * 2 * shape.hidden * 2 * 3)


def test_the_capture_workspace_is_counted_once_and_only_with_capture():
    shape = model_shape(OURO_1_4B)
    assert CAPTURE_WORKSPACE == 32 * MIB  # PyTorch's cuBLAS workspace default on Hopper
    for sizes in ((4,), (1, 2, 4, 8), BUCKETS):
        with_graphs = engine_graphs_bytes(shape, 2, capture=True, sizes=sizes)
        assert with_graphs - CAPTURE_WORKSPACE == (bucket_buffer_bytes(shape, 2, sizes, capture=True)
                                                   + graph_pool_bytes(shape, 2, sizes))
        assert engine_graphs_bytes(shape, 2, capture=False, sizes=sizes) == bucket_buffer_bytes(shape, 2, sizes, False)


#: what one H200 (torch 2.11 + CUDA 13, a random LoopLM of Ouro-1.4B's shape in bf16) reserved for the
#: graphs engine, the cache emptied before and after, with the buckets it met (MiB), and what the plan
#: said then, without the capture stream's workspace (MiB): the first an under-count
H200_RESERVED = [((8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256), 80, 67.5),
                 ((4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384), 80, 98.9)]


@pytest.mark.parametrize("sizes,reserved,before", H200_RESERVED)
def test_the_plan_is_not_below_what_the_h200_reserved(sizes, reserved, before):
    shape = model_shape(OURO_1_4B)
    planned = engine_graphs_bytes(shape, 2, capture=True, sizes=sizes) / MIB
    assert planned - CAPTURE_WORKSPACE / MIB == pytest.approx(before, abs=0.05)
    assert reserved <= planned <= 2 * reserved, planned
