"""Policy log-prob definitions for looped models (docs/design.md §5.3–5.4) and the hybrid log-prob (§2.4).

Inputs, per completion token j of row b:

- ``LP`` (T, B, S): per-loop log-probs ``LP[t-1, b, j] = log P^(t)(y_{b,j})``
- ``exit_probs`` p (T, B, S): the exit distribution (sums to 1 over T)
- ``exit_steps`` t* (B, S): the exit step the rollout sampled from, 1-based, replayed as
  stop-gradient data (the learner never re-decides exits)

Definitions (``kind``):

- ``exit``:    ``log P^(t*_j)(y_j)``
- ``final``:   ``log P^(T)(y_j)``
- ``mixture``: ``log Σ_t p_t P^(t)(y_j) = logsumexp_t(log p_t + LP_t)``
- ``rltt``:    ``Σ_t ω_t LP_t`` with ω (``omega``) one of
  ``exit_pdf`` (ω = p, detached by default), ``uniform`` (1/T),
  ``progressive`` (t^α / Σ_s s^α), ``learned`` (softmax of trainable logits (T,)).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from rltt.errors import RlttError

__all__ = [
    "OMEGAS",
    "POLICY_LOGPROB_KINDS",
    "exit_choice_logprob",
    "hybrid_logprob",
    "loop_weights",
    "policy_logprob",
]

PolicyLogprobKind = Literal["exit", "final", "mixture", "rltt"]
Omega = Literal["exit_pdf", "uniform", "progressive", "learned"]
POLICY_LOGPROB_KINDS = get_args(PolicyLogprobKind)
OMEGAS = get_args(Omega)


def loop_weights(
    omega: str,
    num_loops: int,
    exit_probs: torch.Tensor | None = None,
    alpha: float = 1.0,
    learned_logits: torch.Tensor | None = None,
    detach_weights: bool = True,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The RLTT loop weights ω, normalised over the steps.

    Returns (T, B, S) for ``exit_pdf`` (ω = p, detached when ``detach_weights``) and (T,) for
    the others, which broadcast against LP as (T, 1, 1):

    - ``uniform``:     ω_t = 1 / T
    - ``progressive``: ω_t = t^α / Σ_{s=1..T} s^α   (t 1-based; α = 0 is uniform)
    - ``learned``:     ω = softmax(learned_logits), differentiable in the logits
      (``detach_weights`` does not apply: the logits are trained through ω).
    """
    if omega not in OMEGAS:
        raise RlttError(f"omega: unknown loop weighting {omega!r}; use one of {' | '.join(OMEGAS)}")
    if omega == "exit_pdf":
        if exit_probs is None:
            raise RlttError("omega 'exit_pdf' needs exit_probs")
        return exit_probs.detach() if detach_weights else exit_probs
    if omega == "uniform":
        return torch.full((num_loops,), 1.0 / num_loops, dtype=dtype, device=device)
    if omega == "progressive":
        steps = torch.arange(1, num_loops + 1, dtype=torch.float64, device=device)
        weights = steps.pow(float(alpha))
        return (weights / weights.sum()).to(dtype)
    # learned
    if learned_logits is None:
        raise RlttError("omega 'learned' needs learned_logits (a trainable tensor of shape (T,))")
    if learned_logits.shape != (num_loops,):
        raise RlttError(f"learned_logits: expected shape ({num_loops},), got {tuple(learned_logits.shape)}")
    return torch.softmax(learned_logits, dim=0)


def _check_exit_steps(
    exit_steps: torch.Tensor, num_loops: int, token_shape: torch.Size, mask: torch.Tensor | None
) -> torch.Tensor:
    """Validate recorded 1-based exit steps; return 0-based indices (masked positions → T−1)."""
    if exit_steps.shape != token_shape:
        raise RlttError(f"exit_steps shape {tuple(exit_steps.shape)} != token shape {tuple(token_shape)}")
    if exit_steps.dtype.is_floating_point or exit_steps.dtype == torch.bool:
        raise RlttError(f"exit_steps must be an integer tensor of 1-based steps, got dtype {exit_steps.dtype}")
    steps = exit_steps.long()
    if mask is not None:
        steps = torch.where(mask.bool(), steps, torch.full_like(steps, num_loops))
    bad = (steps < 1) | (steps > num_loops)
    if bool(bad.any()):
        value = int(steps[bad][0])
        raise RlttError(f"exit_steps: recorded exit step {value} is outside 1..{num_loops} (steps are 1-based)")
    return steps - 1


def policy_logprob(
    kind: str,
    LP: torch.Tensor,
    exit_probs: torch.Tensor | None = None,
    exit_steps: torch.Tensor | None = None,
    omega: str = "exit_pdf",
    alpha: float = 1.0,
    learned_logits: torch.Tensor | None = None,
    detach_weights: bool = True,
    *,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token policy log-prob (B, S) of a looped model under definition ``kind``.

    See the module docstring for the formulas. Needs ``exit_steps`` for ``exit``,
    ``exit_probs`` for ``mixture`` and for ``rltt`` with ω = ``exit_pdf``, and
    ``learned_logits`` (T,) for ω = ``learned``. In ``mixture`` the gradient also flows into
    p (the gate is part of that distribution); ``detach_weights`` only concerns the
    ``exit_pdf`` weights of ``rltt``.

    ``mask`` (B, S), optional: positions where it is false are not checked (padding may hold
    any exit step) and are set to 0 in the result.
    """
    if kind not in POLICY_LOGPROB_KINDS:
        raise RlttError(f"logprob kind: unknown policy log-prob {kind!r}; use one of {' | '.join(POLICY_LOGPROB_KINDS)}")
    if LP.dim() < 2:
        raise RlttError(f"policy_logprob: LP must be (T, B, S) with the step axis first, got shape {tuple(LP.shape)}")
    num_loops, token_shape = LP.shape[0], LP.shape[1:]
    if mask is not None and mask.shape != token_shape:
        raise RlttError(f"policy_logprob: mask shape {tuple(mask.shape)} != token shape {tuple(token_shape)}")
    if exit_probs is not None and exit_probs.shape != LP.shape:
        raise RlttError(f"policy_logprob: exit_probs shape {tuple(exit_probs.shape)} != LP shape {tuple(LP.shape)}")

    if kind == "exit":
        if exit_steps is None:
            raise RlttError("logprob kind 'exit' needs the recorded exit_steps")
        index = _check_exit_steps(exit_steps, num_loops, token_shape, mask).to(LP.device)
        out = LP.gather(0, index.unsqueeze(0)).squeeze(0)
    elif kind == "final":
        out = LP[-1]
    elif kind == "mixture":
        if exit_probs is None:
            raise RlttError("logprob kind 'mixture' needs exit_probs")
        tiny = torch.finfo(exit_probs.dtype).tiny
        # clamp: log 0 = -inf would give 0·inf = NaN gradients; the term still vanishes.
        out = torch.logsumexp(torch.log(exit_probs.clamp_min(tiny)) + LP, dim=0)
    else:  # rltt
        weights = loop_weights(
            omega, num_loops, exit_probs, alpha, learned_logits, detach_weights, dtype=LP.dtype, device=LP.device
        )
        if weights.dim() == 1:
            weights = weights.view(num_loops, *([1] * len(token_shape)))
        out = (weights * LP).sum(dim=0)

    if mask is not None:
        out = out.masked_fill(~mask.bool(), 0.0)
    return out


def exit_choice_logprob(exit_probs: torch.Tensor, exit_steps: torch.Tensor) -> torch.Tensor:
    """``log p_{t*}``: the log-probability of each token's recorded exit step under its exit
    distribution p (T, ...), differentiable in p (so in the gate), in fp32; ``exit_steps`` (...)
    1-based. The sampler records the same function of its gates (`rltt.model.exits.exit_logprob`);
    with the ``exit`` log-prob it makes the joint ``log π(t*, y) = log p_{t*} + log P^(t*)(y)`` of
    ``algorithm.exit_action`` (docs/design.md §5.12). p_{t*} is clamped at the smallest normal
    float, as in the ``mixture`` log-prob, so a vanishing p gives a finite value and gradient."""
    index = (exit_steps.long() - 1).clamp(0, exit_probs.shape[0] - 1).to(exit_probs.device)
    chosen = exit_probs.float().gather(0, index.unsqueeze(0)).squeeze(0)
    return torch.log(chosen.clamp_min(torch.finfo(torch.float32).tiny))


def hybrid_logprob(
    logp_dense: torch.Tensor,
    logp_rollout: torch.Tensor,
    logp_dense_at_rollout: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hybrid log-prob (docs/design.md §3): ``logp_dense + sg(logp_rollout − logp_dense(θ_rollout))``.

    Computed in the equivalent form ``sg(logp_rollout) + (logp_dense − sg(logp_dense(θ_rollout)))``
    so that at θ = θ_rollout (where the learner recomputes ``logp_dense`` bit-identically to
    ``logp_dense_at_rollout``) the difference is exactly 0 and the value is the sampler's
    log-prob *bit for bit*: the importance ratio is exactly 1 and nothing is clipped by
    numerics. The gradient is the dense gradient (∂/∂θ logp_dense).

    ``logp_dense_at_rollout`` None means "the learner is still at the rollout weights" (first
    inner iteration): ``logp_dense`` itself, detached, is used. The result has the promoted
    dtype of the inputs, so an fp32 rollout log-prob is kept exactly under a bf16 learner.
    """
    if logp_dense.shape != logp_rollout.shape:
        raise RlttError(f"hybrid_logprob: logp_dense shape {tuple(logp_dense.shape)} != logp_rollout shape {tuple(logp_rollout.shape)}")
    anchor = logp_dense if logp_dense_at_rollout is None else logp_dense_at_rollout
    if anchor.shape != logp_dense.shape:
        raise RlttError(
            f"hybrid_logprob: logp_dense_at_rollout shape {tuple(anchor.shape)} != logp_dense shape {tuple(logp_dense.shape)}"
        )
    return logp_rollout.detach() + (logp_dense - anchor.detach())
