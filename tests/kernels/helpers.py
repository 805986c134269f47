"""Inputs and gradient helpers shared by the kernel tests."""

from __future__ import annotations

import torch


def make_inputs(steps, n, d, vocab, *, dtype=torch.float32, seed=0, scale=1.0):
    """hidden (T, N, d), weight (V, d) as leaf tensors needing grad, and targets (N,)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(steps, n, d, generator=gen) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, d, generator=gen) / d ** 0.5 * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=gen)
    return hidden, weight, targets


def upstream(steps, n, seed=1):
    """Random cotangents for (logprobs, entropy)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(steps, n, generator=gen), torch.randn(steps, n, generator=gen)


def values_and_grads(fn, hidden, weight, grads):
    """Run fn() -> LoopLogProbs, back-propagate the cotangents, return (lp, ent, gh, gw)."""
    out = fn()
    loss = (out.logprobs * grads[0]).sum() + (out.entropy * grads[1]).sum()
    gh, gw = torch.autograd.grad(loss, [hidden, weight])
    return out.logprobs.detach(), out.entropy.detach(), gh, gw
