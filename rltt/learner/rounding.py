"""How a 16-bit learner's fp32 masters become the module weights after each update (``learner.rounding``).

The module weights are what the loss is computed on and what the engines sample with. Rounded to nearest,
an element whose accumulated change is below half a bf16 ulp never moves: at RL learning rates (an Adam
step is about the learning rate, 1e-6..1e-5) and weights of magnitude ~0.02 (a bf16 ulp ≈ 1.2e-4), most
elements stay put for tens of steps while the masters move (``sync/changed_frac`` shows it).

- ``nearest``: round to nearest even (``Tensor.copy_``), the default;
- ``stochastic``: round up or down with the probabilities that make the result the master in
  expectation (bf16: add a uniform 16-bit integer to the fp32 bit pattern, which holds sign and
  magnitude apart, and cut the low 16 bits). The draws are keyed by (update, tensor), so a resumed run
  rounds exactly as the uninterrupted one did. A transient int32 tensor of the tensor's size, one tensor
  at a time (within the optimizer step's workspace in the memory plan). Other dtypes (fp16, fp32) round
  to nearest.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["ROUNDINGS", "round_stochastic"]

#: mixes an (update, tensor index) pair into a generator seed
_GOLDEN = 0x9E3779B97F4A7C15


def _seed(update: int, index: int) -> int:
    x = (update * _GOLDEN + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    return x & ((1 << 63) - 1)


@torch.no_grad()
def round_nearest(p: torch.Tensor, master: torch.Tensor, update: int, index: int) -> None:
    p.copy_(master)  # to nearest (even) in p's dtype


@torch.no_grad()
def round_stochastic(p: torch.Tensor, master: torch.Tensor, update: int, index: int) -> None:
    """``p`` (bf16) = ``master`` (fp32) rounded stochastically, keyed by (``update``, ``index``)."""
    if p.dtype != torch.bfloat16 or master.dtype != torch.float32:
        p.copy_(master)
        return
    gen = torch.Generator(device=master.device).manual_seed(_seed(update, index))
    bits = torch.randint(0, 1 << 16, master.shape, dtype=torch.int32, device=master.device, generator=gen)
    bits.add_(master.view(torch.int32)).bitwise_and_(-(1 << 16))  # sign-magnitude: up in magnitude or not
    p.copy_(bits.view(torch.float32))  # the low 16 bits are 0: exact in bf16


#: ``learner.rounding`` -> ``round(p, master, update, index)``
ROUNDINGS: dict[str, Callable[[torch.Tensor, torch.Tensor, int, int], None]] = {
    "nearest": round_nearest,
    "stochastic": round_stochastic,
}
