"""Public entry point: validate inputs, handle the mask, pick an implementation.

Implementations (``impl=`` or the ``RLTT_LOGPROB_IMPL`` environment variable):

* ``auto`` (default): ``triton`` for CUDA tensors when triton is installed, else ``chunked``;
* ``triton``: fused Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``);
* ``chunked``: chunked PyTorch with a recomputing backward (any device);
* ``reference``: naive, materialises every logit (tests and benchmarks only).
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch

from rltt.errors import RlttError
from rltt.kernels._common import KEPT_ROUNDING, LoopLogProbs, default_chunk_size, floor_thresholds

ENV_VAR = "RLTT_LOGPROB_IMPL"
IMPLS = ("auto", "triton", "chunked", "reference")


def triton_installed() -> bool:
    """Whether the triton package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Whether Triton's CPU interpreter is switched on (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_impl(impl: str | None, device: torch.device) -> str:
    """The concrete implementation for ``impl`` (or the env var) on ``device``."""
    source = "impl"
    if impl is None:
        impl, source = os.environ.get(ENV_VAR, "auto"), ENV_VAR
    name = impl.strip().lower()
    if name not in IMPLS:
        raise RlttError(f"{source}={impl!r} is not a log-prob implementation; "
                        f"choose one of {', '.join(IMPLS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_installed() else "chunked"
    if name == "triton":
        if not triton_installed():
            raise RlttError(f"{source}=triton needs the triton package "
                            "(pip install 'rltt[triton]'); use chunked instead")
        if device.type != "cuda" and not triton_interpreting():
            raise RlttError(f"{source}=triton needs CUDA tensors (got {device.type}); "
                            "set TRITON_INTERPRET=1 to run Triton's interpreter on CPU")
    return name


def _validate(hidden, weight, targets, temperature, mask, chunk_size, kept_floor=None, kept_dtype=None):
    if hidden.dim() != 3:
        raise RlttError(f"hidden must be (T, N, d); got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise RlttError(f"weight must be (V, d={hidden.shape[2]}); got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise RlttError("weight has an empty vocabulary (V = 0)")
    n = hidden.shape[1]
    if targets.shape != (n,) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise RlttError(f"targets must be integer of shape ({n},); "
                        f"got {targets.dtype} {tuple(targets.shape)}")
    if mask is not None and (mask.shape != (n,) or mask.dtype != torch.bool):
        raise RlttError(f"mask must be bool of shape ({n},); got {mask.dtype} {tuple(mask.shape)}")
    if kept_floor is not None:
        if kept_floor.shape != (n,) or kept_floor.dtype.is_floating_point or kept_floor.dtype == torch.bool:
            raise RlttError(f"kept_floor must be integer of shape ({n},); "
                            f"got {kept_floor.dtype} {tuple(kept_floor.shape)}")
    if kept_dtype is not None and kept_dtype not in KEPT_ROUNDING:
        raise RlttError(f"kept_dtype must be one of {', '.join(str(d) for d in KEPT_ROUNDING)} or None; "
                        f"got {kept_dtype!r}")
    for name, tensor in (("weight", weight), ("targets", targets), ("mask", mask), ("kept_floor", kept_floor)):
        if tensor is not None and tensor.device != hidden.device:
            raise RlttError(f"{name} is on {tensor.device} but hidden is on {hidden.device}")
    if not hidden.dtype.is_floating_point or not weight.dtype.is_floating_point:
        raise RlttError(f"hidden and weight must be floating point; got {hidden.dtype}, {weight.dtype}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise RlttError(f"temperature must be a positive finite number; got {temperature!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise RlttError(f"chunk_size must be a positive int; got {chunk_size!r}")


def _rows_impl(name: str):
    if name == "chunked":
        from rltt.kernels.chunked import chunked_logprobs
        return chunked_logprobs
    from rltt.kernels.triton_logprobs import triton_logprobs  # lazy: triton is optional
    return triton_logprobs


def per_loop_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    impl: str | None = None,
    kept_floor: torch.Tensor | None = None,
    kept_dtype: torch.dtype | None = None,
) -> LoopLogProbs:
    """Log-prob of each target under every loop's distribution, and each loop's entropy.

    Args:
        hidden: per-step hidden states (T, N, d) (after the final norm); T = 1 for one step.
        weight: LM-head weight (V, d).
        targets: token ids (N,), integer (int64 preferred).
        temperature: logits are divided by it before the softmax.
        mask: optional (N,) bool; False positions return 0 and get zero gradient (their
            targets may be anything, e.g. -100 padding).
        chunk_size: vocabulary columns per chunk (default sized to a 64 MiB fp32 chunk).
        impl: auto | triton | chunked | reference; default from RLTT_LOGPROB_IMPL, else auto.
        kept_floor: optional (N,) integer: token j's log-probs are renormalised over a kept set
            (top-k/top-p sampling), at every loop t ``K_t = {i : z_t[i] >= z_t[kept_floor[j]]}``
            plus ``kept_floor[j]`` and the target itself (z: the tempered logits); -1 keeps the
            whole vocabulary. The entropy stays the full distribution's. The set is a constant
            of the backward (piecewise constant in hidden and weight).
        kept_dtype: the dtype of the logits the sampler took the kept set from (a rollout's LM-head
            dtype, `RolloutBatch.dtype`): under bf16/fp16 membership compares the logits rounded
            to it before the temperature — the ties that rounding makes at the boundary are
            split as the sampler split them — while the log-probs use the fp32 logits; None or
            torch.float32: the fp32 logits (`rltt.kernels._common.KEPT_ROUNDING`).

    Returns:
        LoopLogProbs(logprobs (T, N), entropy (T, N)), fp32, differentiable with respect to
        hidden and weight (gradients come back in their dtypes). Only one vocabulary chunk of
        logits exists at a time (except for ``reference``).
    """
    _validate(hidden, weight, targets, temperature, mask, chunk_size, kept_floor, kept_dtype)
    name = resolve_impl(impl, hidden.device)
    if kept_floor is not None and not bool((kept_floor >= 0).any()):
        kept_floor = None  # nothing truncated: the untruncated kernels, unchanged
    if name == "reference":
        from rltt.kernels.reference import reference_logprobs
        return reference_logprobs(hidden, weight, targets, temperature=temperature, mask=mask, kept_floor=kept_floor,
                                  kept_dtype=kept_dtype)

    steps, n, d = hidden.shape
    vocab = weight.shape[0]
    targets = targets.long()
    index = None
    if mask is not None and not bool(mask.all()):
        index = mask.nonzero().squeeze(1)
        hidden = hidden.index_select(1, index)
        targets = targets.index_select(0, index)
        if kept_floor is not None:
            kept_floor = kept_floor.index_select(0, index)
    if targets.numel() and bool((targets < 0).any() | (targets >= vocab).any()):
        bad = targets[(targets < 0) | (targets >= vocab)][0].item()
        raise RlttError(f"target id {bad} is outside the vocabulary [0, {vocab}) "
                        "(mask padding positions out)")
    truncation = ()
    if kept_floor is not None:
        kept_floor = kept_floor.long()
        if bool((kept_floor >= vocab).any()):
            raise RlttError(f"kept_floor id {int(kept_floor.max())} is outside the vocabulary [0, {vocab})")
        kept_floor = kept_floor.clamp_min(-1)
        round_to = KEPT_ROUNDING.get(kept_dtype)
        thresholds = floor_thresholds(hidden, weight, kept_floor, 1.0 / temperature, round_to)
        truncation = (kept_floor.repeat(steps), thresholds.reshape(-1), round_to)
    rows = hidden.reshape(steps * hidden.shape[1], d)
    row_targets = targets.repeat(steps)
    chunk = chunk_size or default_chunk_size(rows.shape[0], vocab)
    logprobs, entropy = _rows_impl(name)(rows, weight, row_targets, 1.0 / temperature, chunk, *truncation)
    logprobs = logprobs.view(steps, -1)
    entropy = entropy.view(steps, -1)
    if index is not None:
        logprobs = logprobs.new_zeros(steps, n).index_copy(1, index, logprobs)
        entropy = entropy.new_zeros(steps, n).index_copy(1, index, entropy)
    return LoopLogProbs(logprobs, entropy)
