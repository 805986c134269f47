"""The host work of a rollout, counted with ``torch.profiler``: operators the host dispatches per
(layer · pass) and host–device syncs per pass (issue: on a GPU a decode pass's arithmetic takes well
under a millisecond; each operator launch costs microseconds of host time and each sync stalls the
pipeline and rules out CUDA-graph capture).

What is counted, over one call of ``fn`` (e.g. ``NativeEngine.generate``):

- ``operators``: top-level ``aten::`` operators (no profiled parent), views and metadata ops
  included — what the Python side dispatches. ``launches`` leaves out the ops that launch no
  kernel (views, ``detach``, ``lift_fresh``, ``resolve_*``).
- ``syncs``: ``aten::_local_scalar_dense`` (every ``.item()``, ``bool(t)``, ``int(t)`` goes through
  it), ``aten::nonzero`` and ``aten::masked_select`` (boolean-mask indexing), at any depth. On a CUDA
  tensor each waits for the device.
- ``host_tensors``: ``aten::lift_fresh``, one per ``torch.tensor(python data)``: on a GPU each is a
  host-to-device copy from pageable memory. ``.tolist()``/``.cpu()`` of a CUDA tensor (a sync too)
  dispatch no operator on CPU tensors, so a CPU profile does not see them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select")
NO_LAUNCH_OPS = frozenset({
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::select", "aten::slice", "aten::unsqueeze",
    "aten::squeeze", "aten::transpose", "aten::t", "aten::permute", "aten::expand", "aten::flatten",
    "aten::unflatten", "aten::as_strided", "aten::alias", "aten::detach", "aten::detach_", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::split", "aten::unbind", "aten::chunk", "aten::narrow",
    "aten::empty", "aten::empty_strided",
})


@dataclass
class HostWork:
    """Counts over one profiled call; ``per_*`` divide by its ``passes`` and ``layers``."""

    operators: int
    launches: int
    syncs: int
    host_tensors: int
    passes: int
    layers: int
    top_ops: Counter = field(default_factory=Counter)  # top-level operator name -> count
    sync_sites: Counter = field(default_factory=Counter)  # "op @ file:line" -> count (with stacks)

    def per_layer_pass(self, count: int) -> float:
        return count / max(1, self.passes * self.layers)

    def per_pass(self, count: int) -> float:
        return count / max(1, self.passes)

    def summary(self) -> dict[str, float]:
        return {"operators_per_layer_pass": self.per_layer_pass(self.operators),
                "launches_per_layer_pass": self.per_layer_pass(self.launches),
                "syncs_per_pass": self.per_pass(self.syncs),
                "host_tensors_per_pass": self.per_pass(self.host_tensors),
                "passes": self.passes}


def profile_host_work(fn: Callable[[], Any], layers: int, passes: Callable[[Any], int] | None = None,
                      stacks: bool = False) -> tuple[Any, HostWork]:
    """Run ``fn()`` once under the CPU profiler and count its host work. ``passes(result)`` gives
    the serial passes it ran (default: a `RolloutBatch`'s ``stats.passes``); ``stacks`` records
    where each sync was called from (slower)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=stacks) as prof:
        out = fn()
    events = prof.events()
    top = [e for e in events if e.name.startswith("aten::") and not _under_operator(e)]
    syncs = [e for e in events if e.name in SYNC_OPS]
    sites: Counter = Counter()
    if stacks:
        for e in syncs:
            sites[f"{e.name} @ {_caller(e)}"] += 1
    work = HostWork(
        operators=len(top), launches=sum(e.name not in NO_LAUNCH_OPS for e in top), syncs=len(syncs),
        host_tensors=sum(e.name == "aten::lift_fresh" for e in events),
        passes=int(out.stats.passes) if passes is None else int(passes(out)), layers=layers,
        top_ops=Counter(e.name for e in top), sync_sites=sites)
    return out, work


def _under_operator(event) -> bool:
    """Whether an operator called ``event`` (Python-frame events of a stack profile do not count)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def _caller(event) -> str:
    """The innermost rltt source line above ``event`` in a stack profile."""
    parent = event.cpu_parent
    while parent is not None:
        if "rltt/" in parent.name and "host_work" not in parent.name:
            return parent.name.split("rltt/", 1)[1]
        parent = parent.cpu_parent
    return "?"


def rollout_host_work(engine, prompts: list[list[int]], params, warmup: bool = True,
                      stacks: bool = False) -> tuple[Any, HostWork]:
    """`profile_host_work` of ``engine.generate(prompts, params)`` (a `NativeEngine`), after one
    unprofiled warm-up call."""
    if warmup:
        engine.generate(prompts, params)
    with torch.no_grad():
        return profile_host_work(lambda: engine.generate(prompts, params),
                                 engine.model.config.num_hidden_layers, stacks=stacks)
