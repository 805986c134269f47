"""Chunked PyTorch per-row log-probs with a recomputing backward (the CPU path).

Rows are flattened (loop, token) pairs: ``hidden (M, d)``, ``targets (M,)``. The forward
streams over vocabulary chunks with an online logsumexp, keeping per row only

* ``m``: the running maximum logit,
* ``s = sum_i exp(z_i - m)``,
* ``u = sum_i exp(z_i - m) * (z_i - m)``,

so that ``lse = m + log s`` and ``entropy = log s - u / s``. The backward recomputes each
chunk of logits from the saved hidden states and weight (nothing of size V per row is saved):

    dLP/dz = onehot(y) - p,        dH/dz = -p * (log p + H).

Truncated rows (a kept-set floor, top-k/top-p sampling): the log-prob is renormalised over the
kept set ``K = {i : z_i >= thr} ∪ {floor, y}`` (``thr`` the row's logit of its floor token), with
one more running sum ``s_K = sum_{i in K} exp(z_i - m)`` (``lse_K = m + log s_K``) and
``dLP/dz = onehot(y) - p_K``, ``p_K = 1[i in K] exp(z - lse_K)``. The entropy stays the full
distribution's. With ``round_to`` (a 16-bit rollout, `rltt.kernels._common.KEPT_ROUNDING`) membership
compares the logits rounded to that dtype (before the temperature), as the sampler saw them; the
log-probs themselves use the fp32 logits.
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


def _rounded(z: torch.Tensor, inv_temp: float, round_to: torch.dtype | None) -> torch.Tensor | None:
    """The chunk's untempered logits ``z`` rounded to ``round_to``, then tempered: what kept-set
    membership compares under a 16-bit rollout (None when ``round_to`` is None: the tempered fp32
    logits themselves)."""
    return None if round_to is None else z.to(round_to).float().mul_(inv_temp)


def _kept(z: torch.Tensor, start: int, targets: torch.Tensor, floor: torch.Tensor, thr: torch.Tensor):
    """(rows, chunk) bool: the chunk's columns in each row's kept set (z the chunk's tempered logits,
    rounded as the thresholds ``thr`` are)."""
    cols = torch.arange(start, start + z.shape[1], device=z.device)[None, :]
    return (z >= thr[:, None]) | (cols == floor[:, None]) | (cols == targets[:, None])


def chunked_forward(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    inv_temp: float, chunk_size: int, floor: torch.Tensor | None = None,
                    thr: torch.Tensor | None = None, round_to: torch.dtype | None = None):
    """Return (logprobs, lse, entropy, lse_kept), each (M,) fp32 (``lse_kept`` is ``lse`` without
    ``floor``). ``h`` must already be fp32; ``floor`` (M,) long, -1 = untruncated, with ``thr`` (M,)
    the rows' floor thresholds, rounded to ``round_to`` (module docstring)."""
    rows = h.shape[0]
    m = s = u = s_kept = None
    target_logit = h.new_zeros(rows)
    for start, end in _chunks(weight.shape[0], chunk_size):
        z = h @ weight[start:end].float().T
        rounded = None if floor is None else _rounded(z, inv_temp, round_to)
        z.mul_(inv_temp)
        target_logit += _target_logit(z, targets, start, end)
        kept = None if floor is None else _kept(z if rounded is None else rounded, start, targets, floor, thr)
        chunk_max = z.amax(dim=1)
        m_new = chunk_max if m is None else torch.maximum(m, chunk_max)
        z.sub_(m_new.unsqueeze(1))  # z - m_new
        e = torch.exp(z)
        s_chunk = e.sum(dim=1)
        k_chunk = None if kept is None else torch.where(kept, e, 0.0).sum(dim=1)
        u_chunk = e.mul_(z).sum(dim=1)
        if m is None:
            s, u, s_kept = s_chunk, u_chunk, k_chunk
        else:
            shift = m - m_new  # <= 0
            alpha = torch.exp(shift)
            u = alpha * (u + shift * s) + u_chunk
            s = alpha * s + s_chunk
            if kept is not None:
                s_kept = alpha * s_kept + k_chunk
        m = m_new
    if m is None:  # no rows or empty vocabulary is rejected earlier; keep shapes sane
        empty = h.new_zeros(rows)
        return empty, empty, empty, empty
    log_s = torch.log(s)
    lse = m + log_s
    entropy = log_s - u / s
    lse_kept = lse if floor is None else torch.where(floor >= 0, m + torch.log(s_kept), lse)
    return target_logit - lse_kept, lse, entropy, lse_kept


def _accumulate(g, w, h, targets, grad_lp, inv_temp, start, end, grad_h, grad_w) -> None:
    """Finish one vocabulary chunk's logit gradient ``g`` (the target's +grad_lp, the temperature)
    and add its share to the hidden and weight gradients (None: not needed)."""
    inside = ((targets >= start) & (targets < end)).nonzero().squeeze(1)
    if inside.numel():
        g.index_put_((inside, targets[inside] - start), grad_lp[inside], accumulate=True)
    g.mul_(inv_temp)
    if grad_h is not None:
        grad_h.addmm_(g, w)
    if grad_w is not None:
        grad_w[start:end] = g.T @ h


def chunked_backward(h, weight, targets, lse, entropy, grad_lp, grad_ent, inv_temp,
                     chunk_size, need_hidden: bool, need_weight: bool, floor=None, thr=None, lse_kept=None,
                     round_to=None):
    """Gradients (fp32 for hidden, weight.dtype for weight) by recomputing chunk logits."""
    if floor is not None:
        return _truncated_backward(h, weight, targets, lse, entropy, grad_lp, grad_ent, inv_temp, chunk_size,
                                   need_hidden, need_weight, floor, thr, lse_kept, round_to)
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
        _accumulate(g, w, h, targets, grad_lp, inv_temp, start, end, grad_h, grad_w)
    return grad_h, grad_w


def _truncated_backward(h, weight, targets, lse, entropy, grad_lp, grad_ent, inv_temp, chunk_size,
                        need_hidden, need_weight, floor, thr, lse_kept, round_to=None):
    """`chunked_backward` of truncated rows: dLP/dz = onehot(y) - p_K (module docstring)."""
    grad_h = torch.zeros_like(h) if need_hidden else None
    grad_w = torch.empty_like(weight) if need_weight else None
    for start, end in _chunks(weight.shape[0], chunk_size):
        w = weight[start:end].float()
        z = h @ w.T
        rounded = _rounded(z, inv_temp, round_to)
        z.mul_(inv_temp)
        kept = _kept(z if rounded is None else rounded, start, targets, floor, thr)
        p_kept = torch.where(kept, torch.exp(z - lse_kept[:, None]), 0.0)
        logp = z.sub_(lse[:, None])
        p = torch.exp(logp)
        g = (p * (logp + entropy[:, None]) * grad_ent[:, None]).add_(p_kept * grad_lp[:, None]).neg_()
        _accumulate(g, w, h, targets, grad_lp, inv_temp, start, end, grad_h, grad_w)
    return grad_h, grad_w


class ChunkedLogProbs(torch.autograd.Function):
    """Autograd wrapper: saves only hidden, weight, targets, logsumexp and entropy (and, for
    truncated rows, their floors, thresholds and kept-set logsumexp)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, chunk_size, floor=None, thr=None, round_to=None):
        h = hidden.float()
        logprobs, lse, entropy, lse_kept = chunked_forward(h, weight, targets, inv_temp, chunk_size, floor, thr,
                                                           round_to)
        if floor is None:
            ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        else:
            ctx.save_for_backward(hidden, weight, targets, lse, entropy, floor, thr, lse_kept)
        ctx.inv_temp = inv_temp
        ctx.chunk_size = chunk_size
        ctx.round_to = round_to
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, targets, lse, entropy, *truncation = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]

        def rows_backward(h, targets, lse, entropy, grad_lp, grad_ent, *truncation):
            rounding = (ctx.round_to,) if truncation else ()
            return chunked_backward(h.float(), weight, targets, lse, entropy, grad_lp, grad_ent, ctx.inv_temp,
                                    ctx.chunk_size, need_hidden, need_weight, *truncation, *rounding)

        grad_h, grad_w = backward_live_rows(rows_backward, hidden, targets, lse, entropy, grad_lp.float(),
                                            grad_ent.float(), *truncation)
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def chunked_logprobs(h, weight, targets, inv_temp: float, chunk_size: int, floor=None, thr=None, round_to=None):
    """Rows (M, d) -> (logprobs (M,), entropy (M,)) in fp32, differentiable; ``floor``/``thr`` (M,):
    truncated rows, their membership on logits rounded to ``round_to`` (module docstring), None: none."""
    return ChunkedLogProbs.apply(h, weight, targets, inv_temp, chunk_size, floor, thr, round_to)
