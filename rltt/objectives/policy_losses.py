"""Policy losses per token (docs/design.md §5.6): the table the recipe's ``algorithm.loss`` names.

Each loss is a function ``fn(logp, anchor, adv, keep, eps_low, eps_high) -> LossTerms`` over
(B, S) completion tokens: ``logp`` the policy log-prob (with gradient), ``anchor`` the detached
log-prob the ratio is taken against (π_old), ``adv`` the advantages broadcastable to (B, S),
``keep`` the bool mask of real completion tokens, and the loss's own clip range. It returns the
per-token loss ℓ (aggregated by the caller, `rltt.objectives.rl.policy_loss`) and which tokens
its clipping touched. A new loss is one function and one line of :data:`POLICY_LOSSES`, whose
`PolicyLossSpec` names the recipe keys of its clip range and their defaults.

With ρ_j = exp(logp_j − anchor_j) and A the advantage:

- ``ppo_clip``:  ℓ_j = −min(ρ_j A, clip(ρ_j, 1 − ε_low, 1 + ε_high) A)
- ``reinforce``: ℓ_j = −A logp_j
- ``gspo``:      s = exp(mean_{k∈seq} log ρ_k) per sequence; ŝ_j = sg(s)·exp(logp_j − sg(logp_j));
                 ℓ_j = −min(ŝ_j A, clip(ŝ_j, 1 − ε_low, 1 + ε_high) A)   (GSPO-token form)
- ``cispo``:     ℓ_j = −sg(min(ρ_j, 1 + ε_high)) A logp_j
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from rltt.errors import RlttError

__all__ = ["POLICY_LOSSES", "LossTerms", "PolicyLossKind", "PolicyLossSpec", "cispo", "gspo", "ppo_clip",
           "reinforce"]


@dataclass
class LossTerms:
    """What a loss function returns: ``per_token`` ℓ (B, S) with the gradient, and the bool (B, S)
    masks of the tokens whose gradient (or, for CISPO, importance weight) the clip changed:
    ``clipped_low`` (ratio below 1 − ε_low) and ``clipped_high`` (above 1 + ε_high)."""

    per_token: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor


def _check_range(name: str, eps_low: float | None, eps_high: float | None) -> None:
    if eps_low is not None and not 0.0 <= eps_low < 1.0:
        raise RlttError(f"{name}: eps_low must be in [0, 1), got {eps_low}")
    if eps_high is not None and eps_high < 0.0:
        raise RlttError(f"{name}: eps_high must be >= 0, got {eps_high}")


def _none(keep: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(keep)


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """−min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high) A), the pessimistic PPO bound."""
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(-adv * ratio, -adv * clipped)


def ppo_clip(logp, anchor, adv, keep, eps_low: float, eps_high: float) -> LossTerms:
    """PPO-clip with asymmetric ("clip-higher", DAPO) bounds on the token ratio."""
    _check_range("ppo_clip", eps_low, eps_high)
    ratio = torch.exp(logp - anchor)
    r = ratio.detach()
    return LossTerms(_clipped_objective(ratio, adv, eps_low, eps_high),
                     keep & (adv < 0) & (r < 1.0 - eps_low), keep & (adv > 0) & (r > 1.0 + eps_high))


def reinforce(logp, anchor, adv, keep, eps_low=None, eps_high=None) -> LossTerms:
    """Plain on-policy REINFORCE, −A·logp (RLTT's form); nothing is clipped."""
    return LossTerms(-adv * logp, _none(keep), _none(keep))


def sequence_log_ratio(logp: torch.Tensor, anchor: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, 1): mean over each sequence's kept tokens of logp − anchor (0 for an empty row), with
    the gradient of ``logp``."""
    diff = torch.where(keep, logp - anchor, torch.zeros_like(logp))
    return diff.sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).clamp_min(1).to(logp.dtype)


def gspo(logp, anchor, adv, keep, eps_low: float, eps_high: float) -> LossTerms:
    """GSPO (Zheng et al. 2025): the length-normalised sequence ratio s = exp(mean log ρ), clipped
    per sequence, in the GSPO-token form ŝ_j = sg(s)·π(y_j)/sg(π(y_j)) — its value is s for every
    token, its gradient reaches each token as s·∇logp_j, and with one advantage per sequence
    (and a sequence-mean aggregation) the gradient is GSPO's sequence-level one."""
    _check_range("gspo", eps_low, eps_high)
    s = torch.exp(sequence_log_ratio(logp.detach(), anchor, keep))
    token_ratio = s * torch.exp(logp - logp.detach())
    s = s.expand_as(logp)
    return LossTerms(_clipped_objective(token_ratio, adv, eps_low, eps_high),
                     keep & (adv < 0) & (s < 1.0 - eps_low), keep & (adv > 0) & (s > 1.0 + eps_high))


def cispo(logp, anchor, adv, keep, eps_low: float | None, eps_high: float) -> LossTerms:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the importance ratio clipped to
    [1 − ε_low, 1 + ε_high] and stop-gradiented; ε_low None = no lower bound (the paper's
    choice). No token's gradient is ever dropped: the clip bounds the weight only."""
    _check_range("cispo", eps_low, eps_high)
    r = torch.exp(logp - anchor).detach()
    weight = r.clamp(min=None if eps_low is None else 1.0 - eps_low, max=1.0 + eps_high)
    low = _none(keep) if eps_low is None else keep & (r < 1.0 - eps_low)
    return LossTerms(-weight * adv * logp, low, keep & (r > 1.0 + eps_high))


@dataclass(frozen=True)
class PolicyLossSpec:
    """One entry of :data:`POLICY_LOSSES`: the function, the ``algorithm`` recipe keys of its clip
    range (None: not used) with their defaults, and whether it needs π_old."""

    fn: Callable[..., LossTerms]
    eps_keys: tuple[str | None, str | None] = (None, None)
    defaults: tuple[float | None, float | None] = (None, None)
    needs_old: bool = True


#: name → loss. The defaults are the papers' (DAPO's clip-higher; GSPO's 3e-4 / 4e-4; CISPO without
#: a lower bound and the weight capped at 1 + 3 = 4, ScaleRL's ε_max).
POLICY_LOSSES: dict[str, PolicyLossSpec] = {
    "ppo_clip": PolicyLossSpec(ppo_clip, ("eps_low", "eps_high"), (0.2, 0.28)),
    "reinforce": PolicyLossSpec(reinforce, needs_old=False),
    "gspo": PolicyLossSpec(gspo, ("gspo_eps_low", "gspo_eps_high"), (3e-4, 4e-4)),
    "cispo": PolicyLossSpec(cispo, (None, "cispo_eps_high"), (None, 3.0)),
}

PolicyLossKind = Literal[tuple(POLICY_LOSSES)]  # type: ignore[valid-type]  # the table's names
