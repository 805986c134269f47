"""Language-model objectives for looped models (docs/design.md §1, §5).

A looped model produces, for every target token, one loss per loop step t = 1..T and an
exit distribution p over the steps. The two language-model stages combine them as

- pretraining:  ``L = Σ_t p_t L_t − β H(p)``
- conversion:   ``L = (1 − ε) Σ_t p_t L_t + (ε / T) Σ_t L_t − β H(p)``

where ``L_t`` is the per-token cross-entropy of step t and ``H(p) = −Σ_t p_t log p_t`` the
per-token exit entropy; the per-token values are averaged over unmasked tokens.

Shapes: step axis first. ``step_losses`` and ``exit_probs`` are (T, B, S) — or more
generally (T, *batch) — and ``mask`` is (B, S) (``*batch``), true/1 for tokens that count.
Steps are 1-based in everything user-facing (E[t] ∈ [1, T]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rltt.errors import RlttError

__all__ = [
    "LoopedLMLoss",
    "exit_distribution",
    "exit_entropy",
    "looped_lm_loss",
    "smoothed_exit_loss",
    "step_losses_from_logits",
    "step_losses_from_logprobs",
]


def exit_distribution(gate_probs: torch.Tensor) -> torch.Tensor:
    """Survival exit distribution from per-step gate probabilities.

    ``gate_probs`` holds λ_t on its first axis, shape (T, ...). Returns p of the same shape::

        p_t = λ_t ∏_{s<t} (1 − λ_s)   for t < T
        p_T =     ∏_{s<T} (1 − λ_s)          (λ_T is unused)

    so Σ_t p_t = 1 (telescoping; exact up to rounding). The survival products are a
    cumulative product of (1 − λ), which stays exact when some λ_s is 0 or 1 (no log(0)) and
    has a finite gradient everywhere. For T = 1 the distribution is all ones.
    """
    if gate_probs.dim() < 1 or gate_probs.shape[0] < 1:
        raise RlttError(f"exit_distribution: gate_probs needs a non-empty step axis first, got shape {tuple(gate_probs.shape)}")
    lam = gate_probs[:-1]  # λ_1 .. λ_{T-1}; λ_T never matters
    survival = torch.cumprod(1.0 - lam, dim=0)  # survival[k] = ∏_{s<=k+1} (1 − λ_s)
    ones = torch.ones_like(gate_probs[:1])
    before = torch.cat([ones, survival], dim=0)  # before[t-1] = ∏_{s<t} (1 − λ_s), t = 1..T
    # p_t = λ_t · before_t for t < T; p_T = before_T.
    return torch.cat([lam * before[:-1], before[-1:]], dim=0)


def exit_entropy(exit_probs: torch.Tensor) -> torch.Tensor:
    """Per-position exit entropy ``H(p) = −Σ_t p_t log p_t`` over the first (step) axis.

    Uses 0·log 0 = 0, with a finite gradient at p_t = 0.
    """
    tiny = torch.finfo(exit_probs.dtype).tiny
    return -(exit_probs * torch.log(exit_probs.clamp_min(tiny))).sum(dim=0)


def step_losses_from_logprobs(target_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-step cross-entropy from per-loop log-probs of the targets: ``L_t = −LP_t``.

    ``target_logprobs`` is LP (T, B, S) with ``LP[t, b, j] = log P^(t)(y_{b,j})``, e.g. from
    the fused per-loop log-prob kernel (docs/design.md §4).
    """
    return -target_logprobs


def step_losses_from_logits(step_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-step cross-entropy from full per-step logits (T, B, S, V) and targets (B, S).

    The naive path: it materialises a (T, B, S, V) log-softmax, so use it for small models and
    references; the fused kernels (docs/design.md §4) avoid that. Targets must be valid token ids at
    every position (mask padding in the loss instead, not with an ignore index).
    """
    if step_logits.dim() != targets.dim() + 2 or step_logits.shape[1:-1] != targets.shape:
        raise RlttError(
            f"step_losses_from_logits: logits {tuple(step_logits.shape)} do not match targets {tuple(targets.shape)} "
            "(expected logits (T, *targets.shape, V))"
        )
    logprobs = F.log_softmax(step_logits.float(), dim=-1)
    index = targets.unsqueeze(0).expand(step_logits.shape[0], *targets.shape).unsqueeze(-1)
    return -logprobs.gather(-1, index).squeeze(-1)


@dataclass
class LoopedLMLoss:
    """Result of :func:`looped_lm_loss` / :func:`smoothed_exit_loss`.

    ``loss`` carries the gradient; every other field is detached telemetry:

    - ``expected_loss``: masked mean of Σ_t p_t L_t (the unsmoothed expected-exit loss)
    - ``step_losses``: (T,) masked mean of L_t per step
    - ``exit_probs``: (T,) masked mean of p_t per step (sums to 1)
    - ``mean_exit_step``: E[t] = Σ_t t · mean p_t, 1-based
    - ``exit_entropy``: masked mean of H(p)
    - ``num_tokens``: number of unmasked tokens averaged over
    """

    loss: torch.Tensor
    expected_loss: torch.Tensor
    step_losses: torch.Tensor
    exit_probs: torch.Tensor
    mean_exit_step: torch.Tensor
    exit_entropy: torch.Tensor
    num_tokens: torch.Tensor

    def as_dict(self) -> dict[str, float | list[float]]:
        """Plain Python numbers for logging."""
        return {
            "loss": float(self.loss.detach()),
            "expected_loss": float(self.expected_loss),
            "step_losses": [float(x) for x in self.step_losses],
            "exit_probs": [float(x) for x in self.exit_probs],
            "mean_exit_step": float(self.mean_exit_step),
            "exit_entropy": float(self.exit_entropy),
            "num_tokens": float(self.num_tokens),
        }


def _check_lm_inputs(
    name: str, step_losses: torch.Tensor, exit_probs: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Validate shapes and return the mask as a float tensor of shape step_losses.shape[1:]."""
    if step_losses.dim() < 1:
        raise RlttError(f"{name}: step_losses needs a step axis first, got a scalar")
    if exit_probs.shape != step_losses.shape:
        raise RlttError(f"{name}: exit_probs shape {tuple(exit_probs.shape)} != step_losses shape {tuple(step_losses.shape)}")
    token_shape = step_losses.shape[1:]
    if mask is None:
        return torch.ones(token_shape, dtype=step_losses.dtype, device=step_losses.device)
    if mask.shape != token_shape:
        raise RlttError(f"{name}: mask shape {tuple(mask.shape)} != token shape {tuple(token_shape)}")
    return mask.to(step_losses.dtype)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ x·m / max(Σ m, 1) over all trailing positions (mask broadcasts from the right)."""
    dims = tuple(range(x.dim() - mask.dim(), x.dim()))
    return (x * mask).sum(dim=dims) / mask.sum().clamp_min(1.0)


def _lm_objective(
    name: str,
    step_losses: torch.Tensor,
    exit_probs: torch.Tensor,
    mask: torch.Tensor | None,
    eps: float,
    beta: float,
) -> LoopedLMLoss:
    m = _check_lm_inputs(name, step_losses, exit_probs, mask)
    if not 0.0 <= eps <= 1.0:
        raise RlttError(f"{name}: eps must be in [0, 1], got {eps}")
    num_loops = step_losses.shape[0]
    expected = (exit_probs * step_losses).sum(dim=0)  # Σ_t p_t L_t, per token
    entropy = exit_entropy(exit_probs)
    per_token = expected
    if eps > 0.0:
        per_token = (1.0 - eps) * expected + (eps / num_loops) * step_losses.sum(dim=0)
    per_token = per_token - beta * entropy
    loss = _masked_mean(per_token, m)

    with torch.no_grad():
        mean_p = _masked_mean(exit_probs.detach(), m)
        steps = torch.arange(1, num_loops + 1, dtype=mean_p.dtype, device=mean_p.device)
        return LoopedLMLoss(
            loss=loss,
            expected_loss=_masked_mean(expected.detach(), m),
            step_losses=_masked_mean(step_losses.detach(), m),
            exit_probs=mean_p,
            mean_exit_step=(steps * mean_p).sum(),
            exit_entropy=_masked_mean(entropy.detach(), m),
            num_tokens=m.sum(),
        )


def looped_lm_loss(
    step_losses: torch.Tensor,
    exit_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    beta: float = 0.15,
) -> LoopedLMLoss:
    """Pretraining objective (docs/design.md §5): ``L = mean_tokens[ Σ_t p_t L_t − β H(p) ]``.

    ``step_losses`` L (T, B, S) is the per-token cross-entropy of each step, ``exit_probs`` p
    (T, B, S) the exit distribution, ``mask`` (B, S) selects the tokens averaged over (all
    when None; an all-masked batch gives loss 0). Gradients flow into both L and p; the
    entropy bonus β H(p) keeps the gate from collapsing onto the first step.
    """
    return _lm_objective("looped_lm_loss", step_losses, exit_probs, mask, eps=0.0, beta=beta)


def smoothed_exit_loss(
    step_losses: torch.Tensor,
    exit_probs: torch.Tensor,
    mask: torch.Tensor | None = None,
    eps: float = 0.05,
    beta: float = 0.15,
) -> LoopedLMLoss:
    """Conversion objective (docs/design.md §5)::

        L = mean_tokens[ (1 − ε) Σ_t p_t L_t + (ε / T) Σ_t L_t − β H(p) ]

    Every step keeps a weight of at least ε/T, so no loop is starved of gradient while the
    gate is still untrained. The entropy regulariser uses the unsmoothed p, as does the
    reported telemetry (exit distribution, E[t]). ε = 0 reduces to :func:`looped_lm_loss`.
    """
    return _lm_objective("smoothed_exit_loss", step_losses, exit_probs, mask, eps=eps, beta=beta)
