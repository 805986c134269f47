"""A CPU emulation of CUDA-graph capture semantics, to test `rltt.rollout.buckets`' capture path
without a GPU (tests/rollout/test_buckets.py) and to estimate the host work it leaves
(bench/rollout.py --buckets --host-work).

`RecordedGraph` records every aten operator dispatched between ``begin`` and ``end`` (a
`TorchDispatchMode`) with the very tensors it read and wrote; ``replay`` calls the operators again
on those tensors and copies each fresh result into the tensor the capture produced — what a CUDA
graph does: the same kernels on the same addresses, no Python, no shape or value checks. So a
captured piece that read a value computed outside the graph's static buffers (a tensor made per
pass, a Python number baked in at capture) replays the stale capture-time value here as on a GPU.
The caching allocator's pool is not modelled.

Why it lives in the library and not with the tests: the engine takes its graph maker through a
public argument (`rltt.rollout.buckets.PassBuckets(graphs=...)`), and two users inject this one —
the test suite and the benchmark ``bench/rollout.py --buckets --host-work``, which estimates on any
machine the host work real graphs would leave. It is never imported by the engine itself, and
nothing it does runs in a training or serving call.

`EmulatedGraphs.dispatched` counts the operator calls the replays issued (the recorded operators and
the copies into the captured outputs) and ``launches`` the replays: a profile's top-level operators
less ``dispatched`` plus ``launches`` is what the host would dispatch with real graphs (one launch per
replayed piece).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _storages(tree) -> set:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


class RecordedGraph:
    def __init__(self, owner: "EmulatedGraphs | None" = None):
        self.ops: list = []
        self.mode: _Recorder | None = None
        self.replays = 0
        self.owner = owner

    def replay(self) -> None:
        calls = 0
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            calls += 1
            inputs = _storages((args, kwargs))
            for old, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0]):
                # views and in-place results alias an input: already where the capture left them
                if isinstance(old, torch.Tensor) and old.untyped_storage().data_ptr() not in inputs:
                    old.copy_(new)
                    calls += 1
        self.replays += 1
        if self.owner is not None:
            self.owner.dispatched += calls
            self.owner.launches += 1


class EmulatedGraphs:
    """The `rltt.rollout.buckets.CudaGraphs` interface over `RecordedGraph`."""

    def __init__(self):
        self.made: list[RecordedGraph] = []
        self.dispatched = 0
        self.launches = 0

    def graph(self) -> RecordedGraph:
        graph = RecordedGraph(self)
        self.made.append(graph)
        return graph

    def begin(self, graph: RecordedGraph) -> None:
        graph.mode = _Recorder(graph.ops)
        graph.mode.__enter__()

    def end(self, graph: RecordedGraph) -> None:
        graph.mode.__exit__(None, None, None)
        graph.mode = None

    def warmed(self) -> None:
        pass

    def capturing(self):
        return nullcontext()
