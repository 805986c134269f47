"""How exactly a learner backend accumulates gradients over the micro-batches of one update.

`AccumulationProbe` watches a backend through one update: a tensor hook on every trainable
parameter records each micro-batch's gradient as autograd delivers it (before the backend
accumulates it anywhere), summed exactly (float64) and, for scale, as a running sum in the
gradient's own dtype — what DeepSpeed holds for a bf16 model without
``data_types.grad_accum_dtype``, and what a bf16 module's own ``.grad`` would hold. At the
backend's ``step`` (the accumulation boundary, before the optimizer runs) it reads the gradient
the backend holds (`accumulated_gradients`) and compares. A 16-bit learner — DeepSpeed ZeRO 1-3,
or the torch backend with its fp32 master gradients — stays within one bf16 rounding
(``BF16_ROUNDING``) of the exact sum; a bf16 running sum of many micro-batches is off by more.

Used by ``tests/learner/test_grad_accumulation.py`` and the device check (bench/gpu_check)::

    with AccumulationProbe(learner.backend) as probe:
        learner.update(batch)          # or backend.backward(...) × n, then backend.step()
    probe.result.ok, probe.result.error, probe.result.running_sum_error
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

#: the relative error of one rounding to bf16 (8 significant bits): its unit roundoff
BF16_ROUNDING = 2.0 ** -8


@dataclass(frozen=True)
class AccumulationCheck:
    """The gradient a backend held at its step against the exact sum of the micro-batch gradients.

    ``error``: ‖held − exact‖ / ‖exact‖ over every trainable parameter (one vector);
    ``running_sum_error``: the same for a running sum kept in ``grad_dtype`` (the micro-batch
    gradients' dtype); ``max_rel_error`` / ``running_sum_max_rel_error``: the worst tensor's
    max |difference| / max |exact|; ``held_dtype``: the dtype the backend holds its sum in.
    ``ok``: ``error`` is within one bf16 rounding (``bound``)."""

    micro_steps: int
    tensors: int
    grad_dtype: str
    held_dtype: str
    error: float
    running_sum_error: float
    max_rel_error: float
    running_sum_max_rel_error: float
    exact_norm: float
    bound: float = BF16_ROUNDING

    @property
    def ok(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.bound

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok}


def trainable(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``module``'s parameters that take gradients, by name."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def accumulated_gradients(backend) -> dict[str, torch.Tensor | None]:
    """The gradients ``backend`` holds since its last step, full-shaped, by parameter name of
    ``backend.module`` (None: none held). The torch backend's are its own `held_gradients` (the fp32
    masters' under mixed precision, the module's ``.grad`` otherwise); DeepSpeed's are read where its optimizer accumulates them
    (``deepspeed.utils.safe_get_full_grad``: the fp32 buffer under ``grad_accum_dtype`` fp32); under
    ZeRO 1–3 that is a collective: every rank calls it, in the same order."""
    if hasattr(backend, "held_gradients"):  # the torch backend: its fp32 sums under mixed precision
        return backend.held_gradients()
    params = trainable(backend.module)
    if getattr(backend, "name", None) != "deepspeed":
        return {name: p.grad for name, p in params.items()}
    from deepspeed.utils import safe_get_full_grad

    return {name: safe_get_full_grad(p) for name, p in params.items()}


class AccumulationProbe:
    """Context manager over one update of ``backend`` (see the module docstring); ``result``: the
    `AccumulationCheck` of the first ``backend.step`` inside it (None before).

    The exact sum is this rank's: under data parallelism the backend averages over ranks, so
    compare where every rank runs the same micro-batches (or on one rank). Memory: the exact sum
    (8 bytes per parameter) and the running sum (the gradient's bytes) on the parameters' device."""

    def __init__(self, backend):
        self.backend = backend
        self.result: AccumulationCheck | None = None
        self._handles: list[Any] = []
        self._calls: dict[str, int] = {}

    def __enter__(self) -> AccumulationProbe:
        self._params = trainable(self.backend.module)
        self._exact: dict[str, torch.Tensor] = {}
        self._running: dict[str, torch.Tensor] = {}
        self._grad_dtype: torch.dtype | None = None
        for name, p in self._params.items():
            self._handles.append(p.register_hook(self._recorder(name)))
        self._step = self.backend.step
        self.backend.step = self._checked_step  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.backend.__dict__.get("step") == self._checked_step:
            del self.backend.step

    def _recorder(self, name: str):
        def record(grad: torch.Tensor) -> None:  # one micro-batch's gradient, before anything accumulates it
            g = grad.detach()
            self._grad_dtype = g.dtype
            self._calls[name] = self._calls.get(name, 0) + 1
            if name in self._exact:
                self._exact[name] += g.double()
                self._running[name] = self._running[name] + g  # rounds to the gradient's dtype
            else:
                self._exact[name], self._running[name] = g.double(), g.clone()

        return record

    def _checked_step(self, *args, **kwargs):
        if self.result is None:
            self.result = self._compare(accumulated_gradients(self.backend))
        return self._step(*args, **kwargs)

    def _compare(self, held: dict[str, torch.Tensor | None]) -> AccumulationCheck:
        diffs, running_diffs, exacts = [], [], []
        worst = running_worst = 0.0
        held_dtypes = set()
        for name, p in self._params.items():
            exact = self._exact.get(name)
            got = held.get(name)
            if exact is None:
                exact = torch.zeros(p.shape, dtype=torch.float64, device=p.device)
            if got is None:
                got = torch.zeros_like(exact)
            else:
                held_dtypes.add(str(got.dtype).removeprefix("torch."))
            got = got.detach().reshape(exact.shape).to(exact.device, torch.float64)
            running = self._running[name].double() if name in self._running else torch.zeros_like(exact)
            scale = float(exact.abs().max().clamp_min(1e-300)) if exact.numel() else 1.0
            diff, running_diff = (got - exact).flatten(), (running - exact).flatten()
            if exact.numel():
                worst = max(worst, float(diff.abs().max()) / scale)
                running_worst = max(running_worst, float(running_diff.abs().max()) / scale)
            diffs.append(diff)
            running_diffs.append(running_diff)
            exacts.append(exact.flatten())
        norm = float(torch.cat(exacts).norm()) if exacts else 0.0

        def relative(parts: list[torch.Tensor]) -> float:
            return float(torch.cat(parts).norm()) / norm if norm > 0 else (0.0 if not parts else
                                                                             float(torch.cat(parts).norm()))

        return AccumulationCheck(
            micro_steps=max(self._calls.values(), default=0), tensors=len(self._params),
            grad_dtype=str(self._grad_dtype).removeprefix("torch.") if self._grad_dtype else "none",
            held_dtype=",".join(sorted(held_dtypes)) or "none", error=relative(diffs),
            running_sum_error=relative(running_diffs), max_rel_error=worst,
            running_sum_max_rel_error=running_worst, exact_norm=norm)
