"""Triton per-row log-probs: fused forward and recomputing backward.

Imported only when the Triton implementation is used (triton is an optional dependency).

Forward: a grid of (row block, vocabulary split). Each program walks the vocabulary tiles of
its split, computes a (BLOCK_M, BLOCK_V) tile of logits with ``tl.dot`` over d, and folds it
into an online logsumexp state ``(m, s, u)`` (see :mod:`rltt.kernels.chunked`) plus the
target's logit. No logits ever leave the chip. Splitting the vocabulary keeps the GPU busy
when there are few rows (rollout scoring); the per-split states are merged in PyTorch.

Backward: for each vocabulary chunk, one kernel recomputes the chunk's logits tile by tile
and writes the logit gradient ``g = (onehot(y) - p) * gLP - p (log p + H) * gH`` (scaled by
1/temperature) for that chunk only; the two products ``g @ W_c`` and ``g.T @ h`` then run as
ordinary GEMMs. Peak extra memory is one (M, chunk) buffer.

Precision: on CUDA 16-bit inputs go into ``tl.dot`` as they are (exact products, fp32
accumulation); fp32 inputs use IEEE fp32 dots unless ``torch.backends.cuda.matmul.allow_tf32``
is on. Softmax statistics are fp32 throughout. fp32 states with a 16-bit weight (an fp32 LM head
on a 16-bit model, `LearnerConfig.lm_head_dtype`) upcast the weight tile by tile inside the
kernels (and chunk by chunk in the backward's GEMMs): no fp32 copy of the weight is made.

Truncated rows (top-k/top-p, a kept-set floor per row): `_fwd_trunc_kernel` and
`_grad_logits_trunc_kernel` also fold ``s_K``, the sum over the kept set
``{i : z_i >= thr} ∪ {floor, y}``, and write ``dLP/dz = onehot(y) - p_K`` (see
:mod:`rltt.kernels.chunked`); calls without truncation run the kernels above, unchanged. Under a
16-bit rollout (``ROUND``, `_ROUND_CODES`) membership compares each logit rounded to the rollout's
dtype before the temperature, as the sampler saw it; bf16 is rounded to nearest even on the bits
(the interpreter's bf16 cast truncates).

The kernels are jitted on first use, honouring ``TRITON_INTERPRET`` at that moment, so tests
can switch the interpreter on without re-importing this module.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from rltt.kernels.active_rows import backward_live_rows
from rltt.kernels.triton_compat import fix_interpreter


def _fwd_kernel(H, W, Y, M_OUT, S_OUT, U_OUT, ZY_OUT,
                n_rows, vocab, dim, blocks_per_split, inv_temp,
                BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    y = tl.load(Y + rows64, mask=row_ok, other=-1)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    s_i = tl.zeros([BLOCK_M], tl.float32)
    u_i = tl.zeros([BLOCK_M], tl.float32)
    zy = tl.zeros([BLOCK_M], tl.float32)
    v_begin = split * blocks_per_split * BLOCK_V
    for vb in range(0, blocks_per_split):
        cols = v_begin + vb * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        cols64 = cols.to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            ks = d0 + tl.arange(0, BLOCK_D)
            k_ok = ks < dim
            h = tl.load(H + rows64[:, None] * dim + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + cols64[:, None] * dim + ks[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
        z = acc * inv_temp
        zy += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        z = tl.where(col_ok[None, :], z, -1e30)
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        zc = z - m_new[:, None]
        e = tl.where(col_ok[None, :], tl.exp(zc), 0.0)
        shift = m_i - m_new
        alpha = tl.exp(shift)
        u_i = alpha * (u_i + shift * s_i) + tl.sum(e * zc, axis=1)
        s_i = alpha * s_i + tl.sum(e, axis=1)
        m_i = m_new
    out = split * n_rows + rows64
    tl.store(M_OUT + out, m_i, mask=row_ok)
    tl.store(S_OUT + out, s_i, mask=row_ok)
    tl.store(U_OUT + out, u_i, mask=row_ok)
    tl.store(ZY_OUT + out, zy, mask=row_ok)


def _grad_logits_kernel(H, W, Y, LSE, ENT, GLP, GENT, G,
                        n_rows, vocab, dim, col_start, chunk_width, g_stride, inv_temp,
                        BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = col_start + local
    col_ok = (local < chunk_width) & (cols < vocab)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        ks = d0 + tl.arange(0, BLOCK_D)
        k_ok = ks < dim
        h = tl.load(H + rows64[:, None] * dim + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + cols64[:, None] * dim + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    lse = tl.load(LSE + rows64, mask=row_ok, other=0.0)
    ent = tl.load(ENT + rows64, mask=row_ok, other=0.0)
    glp = tl.load(GLP + rows64, mask=row_ok, other=0.0)
    gent = tl.load(GENT + rows64, mask=row_ok, other=0.0)
    y = tl.load(Y + rows64, mask=row_ok, other=-1)
    ok = row_ok[:, None] & col_ok[None, :]
    logp = tl.where(ok, acc * inv_temp - lse[:, None], 0.0)
    p = tl.where(ok, tl.exp(logp), 0.0)
    g = -p * (glp[:, None] + gent[:, None] * (logp + ent[:, None]))
    g += tl.where(cols[None, :] == y[:, None], glp[:, None], 0.0)
    g = g * inv_temp
    tl.store(G + rows64[:, None] * g_stride + local[None, :], g.to(G.dtype.element_ty), mask=ok)


def _fwd_trunc_kernel(H, W, Y, F, THR, M_OUT, S_OUT, U_OUT, ZY_OUT, SK_OUT,
                      n_rows, vocab, dim, blocks_per_split, inv_temp,
                      BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND: tl.constexpr):
    """`_fwd_kernel` plus ``s_K``: the kept set of row r is ``z >= THR[r]`` (z rounded as ``ROUND``
    says), its floor ``F[r]`` and its target (``THR`` -inf: every column)."""
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    y = tl.load(Y + rows64, mask=row_ok, other=-1)
    f = tl.load(F + rows64, mask=row_ok, other=-1)
    thr = tl.load(THR + rows64, mask=row_ok, other=0.0)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    s_i = tl.zeros([BLOCK_M], tl.float32)
    u_i = tl.zeros([BLOCK_M], tl.float32)
    sk_i = tl.zeros([BLOCK_M], tl.float32)
    zy = tl.zeros([BLOCK_M], tl.float32)
    v_begin = split * blocks_per_split * BLOCK_V
    for vb in range(0, blocks_per_split):
        cols = v_begin + vb * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        cols64 = cols.to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            ks = d0 + tl.arange(0, BLOCK_D)
            k_ok = ks < dim
            h = tl.load(H + rows64[:, None] * dim + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W + cols64[:, None] * dim + ks[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
        z = acc * inv_temp
        zy += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        key = z
        if ROUND == 1:  # bf16: to nearest even on the bits
            bits = acc.to(tl.uint32, bitcast=True)
            key = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True) * inv_temp
        elif ROUND == 2:  # fp16
            key = acc.to(tl.float16).to(tl.float32) * inv_temp
        kept = (key >= thr[:, None]) | (cols[None, :] == f[:, None]) | (cols[None, :] == y[:, None])
        z = tl.where(col_ok[None, :], z, -1e30)
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        zc = z - m_new[:, None]
        e = tl.where(col_ok[None, :], tl.exp(zc), 0.0)
        shift = m_i - m_new
        alpha = tl.exp(shift)
        u_i = alpha * (u_i + shift * s_i) + tl.sum(e * zc, axis=1)
        s_i = alpha * s_i + tl.sum(e, axis=1)
        sk_i = alpha * sk_i + tl.sum(tl.where(kept, e, 0.0), axis=1)
        m_i = m_new
    out = split * n_rows + rows64
    tl.store(M_OUT + out, m_i, mask=row_ok)
    tl.store(S_OUT + out, s_i, mask=row_ok)
    tl.store(U_OUT + out, u_i, mask=row_ok)
    tl.store(ZY_OUT + out, zy, mask=row_ok)
    tl.store(SK_OUT + out, sk_i, mask=row_ok)


def _grad_logits_trunc_kernel(H, W, Y, F, THR, LSE, LSEK, ENT, GLP, GENT, G,
                              n_rows, vocab, dim, col_start, chunk_width, g_stride, inv_temp,
                              BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                              PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROUND: tl.constexpr):
    """`_grad_logits_kernel` of truncated rows: ``g = (onehot(y) - p_K) gLP - p (log p + H) gH``."""
    pid_m = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = col_start + local
    col_ok = (local < chunk_width) & (cols < vocab)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        ks = d0 + tl.arange(0, BLOCK_D)
        k_ok = ks < dim
        h = tl.load(H + rows64[:, None] * dim + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + cols64[:, None] * dim + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    lse = tl.load(LSE + rows64, mask=row_ok, other=0.0)
    lse_k = tl.load(LSEK + rows64, mask=row_ok, other=0.0)
    thr = tl.load(THR + rows64, mask=row_ok, other=0.0)
    ent = tl.load(ENT + rows64, mask=row_ok, other=0.0)
    glp = tl.load(GLP + rows64, mask=row_ok, other=0.0)
    gent = tl.load(GENT + rows64, mask=row_ok, other=0.0)
    y = tl.load(Y + rows64, mask=row_ok, other=-1)
    f = tl.load(F + rows64, mask=row_ok, other=-1)
    ok = row_ok[:, None] & col_ok[None, :]
    z = acc * inv_temp
    key = z
    if ROUND == 1:  # bf16: to nearest even on the bits
        bits = acc.to(tl.uint32, bitcast=True)
        key = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True) * inv_temp
    elif ROUND == 2:  # fp16
        key = acc.to(tl.float16).to(tl.float32) * inv_temp
    kept = ok & ((key >= thr[:, None]) | (cols[None, :] == f[:, None]) | (cols[None, :] == y[:, None]))
    logp = tl.where(ok, z - lse[:, None], 0.0)
    p = tl.where(ok, tl.exp(logp), 0.0)
    p_k = tl.where(kept, tl.exp(z - lse_k[:, None]), 0.0)
    g = -p * (gent[:, None] * (logp + ent[:, None])) - p_k * glp[:, None]
    g += tl.where(cols[None, :] == y[:, None], glp[:, None], 0.0)
    g = g * inv_temp
    tl.store(G + rows64[:, None] * g_stride + local[None, :], g.to(G.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> SimpleNamespace:
    """Jit the kernels for the current mode (the interpreter is chosen at jit time)."""
    if interpret:  # the cache key; triton reads TRITON_INTERPRET itself
        fix_interpreter()  # Triton < 3.7 under NumPy >= 2.4 (rltt.kernels.triton_compat)
    return SimpleNamespace(fwd=triton.jit(_fwd_kernel), grad_logits=triton.jit(_grad_logits_kernel),
                           fwd_trunc=triton.jit(_fwd_trunc_kernel),
                           grad_logits_trunc=triton.jit(_grad_logits_trunc_kernel))


#: the ``ROUND`` code of the truncated kernels per kept-set rounding (`rltt.kernels._common.KEPT_ROUNDING`)
_ROUND_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _config(device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> dict:
    """Tile sizes and dot precision. The interpreter gets small tiles (it runs on numpy) and
    upcasts 16-bit tiles before ``tl.dot`` (its numpy dot multiplies bf16 bit patterns as
    integers); on CUDA, 16-bit tiles go to the tensor cores as they are, and a 16-bit weight
    under fp32 states (``weight_dtype`` ≠ ``dtype``) is upcast tile by tile."""
    precision = "ieee"
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        precision = "tf32"
    if device.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_V=32, BLOCK_D=16, PRECISION=precision, UPCAST=True)
    mixed = weight_dtype is not None and weight_dtype != dtype
    return dict(BLOCK_M=64, BLOCK_V=64, BLOCK_D=64, PRECISION=precision, UPCAST=mixed,
                num_warps=4)


def _num_splits(row_blocks: int, vocab_blocks: int, device: torch.device) -> int:
    """Vocabulary splits so that the forward grid has about 4 programs per SM."""
    if device.type != "cuda":
        return min(2, vocab_blocks)  # exercises the split merge under the interpreter
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(vocab_blocks, -(-target // max(row_blocks, 1))))


def triton_forward(h, weight, targets, inv_temp: float, splits: int | None = None):
    """Return (logprobs, lse, entropy), each (M,) fp32; h and weight share a dtype (or h is fp32)."""
    return _forward(h, weight, targets, inv_temp, splits)[:3]


def triton_truncated_forward(h, weight, targets, floor, thr, inv_temp: float, splits: int | None = None,
                             round_to: torch.dtype | None = None):
    """Return (logprobs, lse, entropy, lse_kept), each (M,) fp32, of rows truncated to their kept
    sets (``floor`` (M,) long, -1 = untruncated; ``thr`` (M,) fp32 their thresholds; membership on
    logits rounded to ``round_to``)."""
    return _forward(h, weight, targets, inv_temp, splits, floor, thr, round_to)


def _forward(h, weight, targets, inv_temp, splits, floor=None, thr=None, round_to=None):
    n_rows, dim = h.shape
    vocab = weight.shape[0]
    cfg = _config(h.device, h.dtype, weight.dtype)
    row_blocks = triton.cdiv(n_rows, cfg["BLOCK_M"])
    vocab_blocks = triton.cdiv(vocab, cfg["BLOCK_V"])
    splits = splits or _num_splits(row_blocks, vocab_blocks, h.device)
    per_split = triton.cdiv(vocab_blocks, splits)
    splits = triton.cdiv(vocab_blocks, per_split)  # no empty split
    truncated = floor is not None
    stats = torch.empty(5 if truncated else 4, splits, n_rows, device=h.device, dtype=torch.float32)
    m, s, u, zy = stats.unbind(0)[:4]
    kernels = _kernels(_interpreting())
    if truncated:
        sk = stats[4]
        kernels.fwd_trunc[(row_blocks, splits)](
            h, weight, targets, floor, thr, m, s, u, zy, sk, n_rows, vocab, dim, per_split, inv_temp, **cfg,
            ROUND=_ROUND_CODES[round_to])
    else:
        kernels.fwd[(row_blocks, splits)](
            h, weight, targets, m, s, u, zy, n_rows, vocab, dim, per_split, inv_temp, **cfg)
    m_all = m.amax(dim=0)
    shift = m - m_all
    alpha = torch.exp(shift)
    s_all = (alpha * s).sum(dim=0)
    u_all = (alpha * (u + shift * s)).sum(dim=0)
    log_s = torch.log(s_all)
    lse = m_all + log_s
    entropy = log_s - u_all / s_all
    if not truncated:
        return zy.sum(dim=0) - lse, lse, entropy, lse
    lse_kept = torch.where(floor >= 0, m_all + torch.log((alpha * sk).sum(dim=0)), lse)
    return zy.sum(dim=0) - lse_kept, lse, entropy, lse_kept


def triton_backward(h, weight, targets, lse, entropy, grad_lp, grad_ent, inv_temp: float,
                    chunk_size: int, need_hidden: bool, need_weight: bool, floor=None, thr=None, lse_kept=None,
                    round_to=None):
    """Gradients for h (fp32) and weight (its dtype), one vocabulary chunk at a time; ``floor``,
    ``thr``, ``lse_kept``, ``round_to``: truncated rows (`triton_truncated_forward`)."""
    n_rows, dim = h.shape
    vocab = weight.shape[0]
    cfg = _config(h.device, h.dtype, weight.dtype)
    # the GEMMs run in the input dtype (fp32 accumulation inside cuBLAS / the CPU BLAS)
    g_buf = torch.empty(n_rows, min(chunk_size, vocab), device=h.device, dtype=h.dtype)
    grad_h = torch.zeros(n_rows, dim, device=h.device, dtype=torch.float32) if need_hidden else None
    grad_w = torch.empty_like(weight) if need_weight else None
    kernels = _kernels(_interpreting())
    for start in range(0, vocab, chunk_size):
        width = min(chunk_size, vocab - start)
        g = g_buf[:, :width]
        grid = (triton.cdiv(n_rows, cfg["BLOCK_M"]), triton.cdiv(width, cfg["BLOCK_V"]))
        if floor is None:
            kernels.grad_logits[grid](h, weight, targets, lse, entropy, grad_lp, grad_ent, g,
                                      n_rows, vocab, dim, start, width, g.stride(0), inv_temp, **cfg)
        else:
            kernels.grad_logits_trunc[grid](h, weight, targets, floor, thr, lse, lse_kept, entropy, grad_lp,
                                            grad_ent, g, n_rows, vocab, dim, start, width, g.stride(0), inv_temp,
                                            **cfg, ROUND=_ROUND_CODES[round_to])
        w = weight[start:start + width]
        if need_hidden:
            grad_h += g @ (w if w.dtype == g.dtype else w.to(g.dtype))  # a 16-bit weight under fp32 states: the chunk
        if need_weight:
            grad_w[start:start + width] = g.T @ h
    return grad_h, grad_w


class TritonLogProbs(torch.autograd.Function):
    """Autograd wrapper: saves only hidden, weight, targets, logsumexp and entropy (and, for
    truncated rows, their floors, thresholds and kept-set logsumexp)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, chunk_size, floor=None, thr=None, round_to=None):
        h, w = _same_dtype(hidden.contiguous(), weight.contiguous())
        targets = targets.contiguous()
        if floor is not None:
            floor, thr = floor.contiguous(), thr.float().contiguous()
        if h.shape[0] == 0:
            empty = h.new_zeros(0, dtype=torch.float32)
            logprobs, lse, entropy, lse_kept = empty, empty, empty.clone(), empty
        elif floor is None:
            logprobs, lse, entropy = triton_forward(h, w, targets, inv_temp)
        else:
            logprobs, lse, entropy, lse_kept = triton_truncated_forward(h, w, targets, floor, thr, inv_temp,
                                                                        round_to=round_to)
        if floor is None:
            ctx.save_for_backward(h, w, targets, lse, entropy)
        else:
            ctx.save_for_backward(h, w, targets, lse, entropy, floor, thr, lse_kept)
        ctx.inv_temp, ctx.chunk_size, ctx.round_to = inv_temp, chunk_size, round_to
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lp, grad_ent):
        h, w, targets, lse, entropy, *truncation = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]

        def rows_backward(h, targets, lse, entropy, grad_lp, grad_ent, *truncation):
            if h.shape[0] == 0:
                return (torch.zeros_like(h) if need_hidden else None), (torch.zeros_like(w) if need_weight else None)
            truncation = tuple(t.contiguous() for t in truncation)
            rounding = (ctx.round_to,) if truncation else ()
            return triton_backward(h, w, targets, lse, entropy, grad_lp.contiguous(), grad_ent.contiguous(),
                                   ctx.inv_temp, ctx.chunk_size, need_hidden, need_weight, *truncation, *rounding)

        grad_h, grad_w = backward_live_rows(rows_backward, h, targets, lse, entropy, grad_lp.float(),
                                            grad_ent.float(), *truncation)
        hidden_dtype, weight_dtype = ctx.dtypes
        grad_h = grad_h.to(hidden_dtype) if grad_h is not None else None
        grad_w = grad_w.to(weight_dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None, None


def _same_dtype(h: torch.Tensor, w: torch.Tensor):
    """Kernels need one input dtype, or fp32 states with a 16-bit weight (upcast inside the
    kernels, no fp32 copy of the weight); other mixes are both computed in fp32."""
    if h.dtype == w.dtype or h.dtype == torch.float32:
        return h, w
    return h.float(), w.float()


def triton_logprobs(h, weight, targets, inv_temp: float, chunk_size: int, floor=None, thr=None, round_to=None):
    """Rows (M, d) -> (logprobs (M,), entropy (M,)) in fp32, differentiable; ``floor``/``thr`` (M,):
    truncated rows, their membership on logits rounded to ``round_to`` (module docstring), None: none."""
    return TritonLogProbs.apply(h, weight, targets, inv_temp, chunk_size, floor, thr, round_to)
