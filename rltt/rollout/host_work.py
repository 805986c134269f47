"""The host work of a rollout, counted with ``torch.profiler``: operators the host dispatches per
(layer · pass) and host–device syncs per pass (issue: on a GPU a decode pass's arithmetic takes well
under a millisecond; each operator launch costs microseconds of host time and each sync stalls the
pipeline and rules out CUDA-graph capture).

What is counted, over one call of ``fn`` (e.g. ``NativeEngine.generate``):

- ``operators``: top-level ``aten::`` operators (no profiled parent), views and metadata ops
  included — what the Python side dispatches — and rltt's own (`OPERATORS`). ``launches``
  leaves out the ops that launch no kernel (views, ``detach``, ``lift_fresh``, ``resolve_*``).
- ``syncs``: ``aten::_local_scalar_dense`` (every ``.item()``, ``bool(t)``, ``int(t)`` goes through
  it), ``aten::nonzero`` and ``aten::masked_select`` (boolean-mask indexing), at any depth. On a CUDA
  tensor each waits for the device.
- ``host_tensors``: ``aten::lift_fresh``, one per ``torch.tensor(python data)``: on a GPU each one
  the engine moves to the device is a host-to-device copy (``torch.tensor(..., device=cuda)`` from
  pageable memory waits for the stream); the pass records' tensors stay on the host.
- ``reads``: Python reads of tensor values — ``.tolist()``, ``.item()``, ``.cpu()``, ``.numpy()``,
  ``bool(t)``, ``int(t)``, ``float(t)`` (not ``.to("cpu")``: the engine does not use it) — seen by a `TorchFunctionMode`, so they are
  counted on CPU too, where they dispatch no operator. On a GPU each read of a device tensor is a
  device-to-host transfer that waits for the device. The engine reads only device tensors during its
  passes (its own bookkeeping is Python lists), so on its passes this is the count of transfers;
  ``pass_reads`` splits it by pass (`mark_pass`, called by the engine at the start of each pass), and
  ``pass_made`` counts the ``torch.tensor`` / ``torch.as_tensor`` calls on Python data in each pass,
  ``pass_uploads`` the engine's uploads of them to its device (`note_upload`; the others stay on the host).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

#: the operators counted: PyTorch's, and rltt's own (`rltt.kernels.slot_attention`'s launches of a
#: captured pass, which a CPU emulation of the capture records and replays as operators; what they
#: call inside is theirs, not the host's per-pass work)
OPERATORS = ("aten::", "rltt::")
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
    reads: int = 0  # tensor values read into Python (see the module docstring), prefill and wrap-up included
    pass_reads: list[int] = field(default_factory=list)  # reads made during each marked pass, in order
    pass_made: list[int] = field(default_factory=list)  # torch.tensor / as_tensor(python data) per marked pass
    pass_uploads: list[int] = field(default_factory=list)  # the engine's uploads of host-built indices per pass

    def per_pass_reads(self) -> float:
        return sum(self.pass_reads) / max(1, len(self.pass_reads))

    def per_layer_pass(self, count: int) -> float:
        return count / max(1, self.passes * self.layers)

    def per_pass(self, count: int) -> float:
        return count / max(1, self.passes)

    def summary(self) -> dict[str, float]:
        return {"operators_per_layer_pass": self.per_layer_pass(self.operators),
                "launches_per_layer_pass": self.per_layer_pass(self.launches),
                "syncs_per_pass": self.per_pass(self.syncs),
                "host_tensors_per_pass": self.per_pass(self.host_tensors),
                "reads_per_pass": self.per_pass_reads(),
                "made_per_pass": sum(self.pass_made) / max(1, len(self.pass_made)),
                "uploads_per_pass": sum(self.pass_uploads) / max(1, len(self.pass_uploads)),
                "max_reads_in_a_pass": max(self.pass_reads, default=0),
                "passes": self.passes}


def profile_host_work(fn: Callable[[], Any], layers: int, passes: Callable[[Any], int] | None = None,
                      stacks: bool = False) -> tuple[Any, HostWork]:
    """Run ``fn()`` once under the CPU profiler and count its host work. ``passes(result)`` gives
    the serial passes it ran (default: a `RolloutBatch`'s ``stats.passes``); ``stacks`` records
    where each sync was called from (slower)."""
    from torch.profiler import ProfilerActivity, profile

    reads = ReadCounter()
    with profile(activities=[ProfilerActivity.CPU], with_stack=stacks) as prof, reads:
        out = fn()
    events = prof.events()
    top = [e for e in events if e.name.startswith(OPERATORS) and not _under_operator(e)]
    syncs = [e for e in events if e.name in SYNC_OPS]
    sites: Counter = Counter()
    if stacks:
        for e in syncs:
            sites[f"{e.name} @ {_caller(e)}"] += 1
    work = HostWork(
        operators=len(top), launches=sum(e.name not in NO_LAUNCH_OPS for e in top), syncs=len(syncs),
        host_tensors=sum(e.name == "aten::lift_fresh" for e in events),
        passes=int(out.stats.passes) if passes is None else int(passes(out)), layers=layers,
        top_ops=Counter(e.name for e in top), sync_sites=sites, reads=reads.total, pass_reads=reads.passes,
        pass_made=reads.pass_made, pass_uploads=reads.pass_uploads)
    return out, work


#: the tensor methods that hand a tensor's values to Python (on a CUDA tensor: a device-to-host copy
#: the host waits for)
READ_METHODS = frozenset({"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"})


class ReadCounter(TorchFunctionMode):
    """Counts reads of tensor values into Python while active (``total``), and per pass: `mark_pass`
    starts a new entry of ``passes``."""

    active: "ReadCounter | None" = None

    def __init__(self):
        super().__init__()
        self.total = 0
        self.passes: list[int] = []
        self.pass_made: list[int] = []  # tensors made from Python data during each pass
        self.pass_uploads: list[int] = []  # `note_upload` calls during each pass
        self.host_only = False  # inside `host_list`
        self.in_pass = False  # between `mark_pass` and `end_passes`

    def __enter__(self):
        ReadCounter.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        ReadCounter.active = None
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.in_pass and name in ("tensor", "as_tensor") and args and not isinstance(args[0], torch.Tensor):
            self.pass_made[-1] += 1
        if name in READ_METHODS and not self.host_only:
            self.total += 1
            if self.in_pass:
                self.passes[-1] += 1
        return func(*args, **kwargs)


def host_list(t: torch.Tensor) -> list:
    """``t.tolist()`` of a tensor the host made itself (on the CPU whatever the model's device):
    not a device read, so not counted."""
    if t.device.type != "cpu":
        raise ValueError("host_list reads host tensors only")
    counter = ReadCounter.active
    if counter is None:
        return t.tolist()
    counter.host_only = True
    try:
        return t.tolist()
    finally:
        counter.host_only = False


def mark_pass() -> None:
    """Start counting a new pass's reads (the engine calls it once per pass; nothing without a
    `ReadCounter` active)."""
    if ReadCounter.active is not None:
        ReadCounter.active.passes.append(0)
        ReadCounter.active.pass_made.append(0)
        ReadCounter.active.pass_uploads.append(0)
        ReadCounter.active.in_pass = True


def note_upload() -> None:
    """The engine made one host-to-device copy of host-built data (`rltt.rollout.executor.upload`)."""
    counter = ReadCounter.active
    if counter is not None and counter.in_pass:
        counter.pass_uploads[-1] += 1


def end_passes() -> None:
    """The passes are over: later reads (a rollout's wrap-up) count in the total only."""
    if ReadCounter.active is not None:
        ReadCounter.active.in_pass = False


def _under_operator(event) -> bool:
    """Whether an operator called ``event`` (Python-frame events of a stack profile do not count)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(OPERATORS):
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
