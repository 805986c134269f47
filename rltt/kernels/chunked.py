"""Chunked PyTorch per-row log-probs with a recomputing backward (the CPU path).

Rows are flattened (loop, token) pairs: ``hidden (M, d)``, ``targets (M,)``. The forward
streams over vocabulary chunks with an online logsumexp, keeping per row only

* ``m``: the running maximum logit,
* ``s = sum_i exp(z_i - m)``,
* ``u = sum_i exp(z_i - m) * (z_i - m)``,

so that ``lse = m + log s`` and ``entropy = log s - u / s``. The backward recomputes each
chunk of logits from the saved hidden states and weight (nothing of size V per row is saved):

    dLP/dz = onehot(y) - p,        dH/dz = -p * (log p + H).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from rltt.kernels.active_rows import backward_live_rows


def _chunks(vocab: int, chunk_size: int):
    for start in range(0, vocab, chunk_size):
        yield start, min(start + chunk_size, vocab)


def _target_logit(z: torch.Tensor, targets: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """z[r, targets[r] - start] where the target falls in [start, end), else 0."""
    inside = (targets >= start) & (targets < end)
    local = (targets - start).clamp(0, end - start - 1).unsqueeze(1)
    picked = z.gather(1, local).squeeze(1)
    return torch.where(inside, picked, torch.zeros_like(picked))


def chunked_forward(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    inv_temp: float, chunk_size: int):
    """Return (logprobs, lse, entropy), each (M,) fp32. ``h`` must already be fp32."""
    rows = h.shape[0]
    m = s = u = None
    target_logit = h.new_zeros(rows)
    for start, end in _chunks(weight.shape[0], chunk_size):
        z = h @ weight[start:end].float().T
        z.mul_(inv_temp)
        target_logit += _target_logit(z, targets, start, end)
        chunk_max = z.amax(dim=1)
        m_new = chunk_max if m is None else torch.maximum(m, chunk_max)
        z.sub_(m_new.unsqueeze(1))  # z - m_new
        e = torch.exp(z)
        s_chunk = e.sum(dim=1)
        u_chunk = e.mul_(z).sum(dim=1)
        if m is None:
            s, u = s_chunk, u_chunk
        else:
            shift = m - m_new  # <= 0
            alpha = torch.exp(shift)
            u = alpha * (u + shift * s) + u_chunk
            s = alpha * s + s_chunk
        m = m_new
    if m is None:  # no rows or empty vocabulary is rejected earlier; keep shapes sane
        empty = h.new_zeros(rows)
        return empty, empty, empty
    log_s = torch.log(s)
    lse = m + log_s
    entropy = log_s - u / s
    return target_logit - lse, lse, entropy


def chunked_backward(h, weight, targets, lse, entropy, grad_lp, grad_ent, inv_temp,
                     chunk_size, need_hidden: bool, need_weight: bool):
    """Gradients (fp32 for hidden, weight.dtype for weight) by recomputing chunk logits."""
    grad_h = torch.zeros_like(h) if need_hidden else None
    grad_w = torch.empty_like(weight) if need_weight else None
    lse_col = lse.unsqueeze(1)
    ent_col = entropy.unsqueeze(1)
    glp_col = grad_lp.unsqueeze(1)
    gent_col = grad_ent.unsqueeze(1)
    for start, end in _chunks(weight.shape[0], chunk_size):
        w = weight[start:end].float()
        logp = h @ w.T
        logp.mul_(inv_temp).sub_(lse_col)
        p = torch.exp(logp)
        # g = -p * (glp + gent * (log p + H)), reusing logp's storage for the bracket
        bracket = logp.add_(ent_col).mul_(gent_col).add_(glp_col)
        g = p.mul_(bracket).neg_()
        inside = ((targets >= start) & (targets < end)).nonzero().squeeze(1)
        if inside.numel():
            g.index_put_((inside, targets[inside] - start), grad_lp[inside], accumulate=True)
        g.mul_(inv_temp)
        if need_hidden:
            grad_h.addmm_(g, w)
        if need_weight:
            grad_w[start:end] = g.T @ h
    return grad_h, grad_w


class ChunkedLogProbs(torch.autograd.Function):
    """Autograd wrapper: saves only hidden, weight, targets, logsumexp and entropy."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, chunk_size):
        h = hidden.float()
        logprobs, lse, entropy = chunked_forward(h, weight, targets, inv_temp, chunk_size)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.inv_temp = inv_temp
        ctx.chunk_size = chunk_size
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]

        def rows_backward(h, targets, lse, entropy, grad_lp, grad_ent):
            return chunked_backward(h.float(), weight, targets, lse, entropy, grad_lp, grad_ent, ctx.inv_temp,
                                    ctx.chunk_size, need_hidden, need_weight)

        grad_h, grad_w = backward_live_rows(rows_backward, hidden, targets, lse, entropy, grad_lp.float(), grad_ent.float())
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, None, None, None


def chunked_logprobs(h, weight, targets, inv_temp: float, chunk_size: int):
    """Rows (M, d) -> (logprobs (M,), entropy (M,)) in fp32, differentiable."""
    return ChunkedLogProbs.apply(h, weight, targets, inv_temp, chunk_size)
