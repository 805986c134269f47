"""Backward over the rows that receive a gradient.

A loss often reads only some of the per-loop log-probs — a final-loop policy log-prob reads
loop T, not loops 1..T−1 — and a row whose upstream gradients (log-prob and entropy) are both
zero contributes exactly zero to the hidden and weight gradients. The kernels' backward
passes run on the other rows only.
"""

from __future__ import annotations

import torch


def backward_live_rows(backward, h, targets, lse, entropy, grad_lp, grad_ent, *extra):
    """``backward(h, targets, lse, entropy, grad_lp, grad_ent, *extra) -> (grad_h | None, grad_w | None)``
    on the rows with a non-zero upstream gradient; ``extra``: more per-row tensors (or None), taken
    on the same rows; ``grad_h`` is scattered back to all rows."""
    live = (grad_lp != 0) | (grad_ent != 0)
    if bool(live.all()):
        return backward(h, targets, lse, entropy, grad_lp, grad_ent, *extra)
    index = live.nonzero().squeeze(1)
    extra = tuple(None if t is None else t[index] for t in extra)
    grad_h, grad_w = backward(h.index_select(0, index), targets[index], lse[index], entropy[index],
                              grad_lp[index], grad_ent[index], *extra)
    if grad_h is not None:
        grad_h = torch.zeros(h.shape, dtype=grad_h.dtype, device=grad_h.device).index_copy_(0, index, grad_h)
    return grad_h, grad_w
