"""Advantage estimators over groups of completions (docs/design.md §5.5).

A batch of B = n_groups · G rows holds the G completions of one prompt in consecutive rows
``[g*G : (g+1)*G]``. An estimator maps the rewards of the batch, seen as (n_groups, G), to one
advantage per row; the recipe's ``algorithm.advantage`` names one entry of
:data:`ADVANTAGE_ESTIMATORS` and ``algorithm.advantage_scale`` the normaliser. A new estimator
is one function with the signature of :func:`grpo` and one line in the table.

With r the rewards, δ = ``eps`` and std the sample (Bessel-corrected) standard deviation:

- ``grpo``:         A_i = (r_i − mean_g r) / σ
- ``rloo``:         A_i = (r_i − mean_{g, k≠i} r_k) / σ = G/(G−1) · (r_i − mean_g r) / σ
- ``reinforce_pp``: x_i = r_i − mean_g r;  A_i = (x_i − mean_B x) / (std_B x + δ)

where σ = std_g r + δ (``advantage_scale: group``), std_B r + δ (``batch``) or 1 (``none``).
REINFORCE++ normalises with the batch statistics of the group-centred rewards itself, so it
accepts ``advantage_scale: batch`` only (:data:`SCALES_OF`). Every estimator gives a group whose
rewards are all equal exactly zero advantage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, get_args

import torch

from rltt.errors import RlttError

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_SCALES",
    "COMPUTE_PRICES",
    "SCALES_OF",
    "GroupAdvantages",
    "group_advantages",
    "grpo",
    "reinforce_pp",
    "rloo",
    "uniform_groups",
]

AdvantageScale = Literal["group", "batch", "none"]
ADVANTAGE_SCALES = get_args(AdvantageScale)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) rewards → (n_groups, G) view, validating the layout."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise RlttError(f"group_size must be a positive integer, got {group_size!r}")
    if rewards.dim() != 1:
        raise RlttError(f"rewards must be a 1-D tensor (B,), got shape {tuple(rewards.shape)}")
    if rewards.shape[0] % group_size != 0:
        raise RlttError(f"batch of {rewards.shape[0]} rewards is not a whole number of groups of group_size={group_size}")
    return rewards.view(-1, group_size)


def _std(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sample std (0 for a single element) over ``dim`` (None: all elements)."""
    n = x.numel() if dim is None else x.shape[dim]
    if n <= 1:
        return torch.zeros(()) if dim is None else torch.zeros_like(x.select(dim, 0))
    return x.std() if dim is None else x.std(dim=dim)


def _scaled(centred: torch.Tensor, grouped: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
    """``centred`` divided by the ``scale`` normaliser of the rewards ``grouped``."""
    if scale == "group":
        return centred / (_std(grouped, 1).unsqueeze(1) + eps)
    if scale == "batch":
        return centred / (_std(grouped.flatten()).to(grouped) + eps)
    return centred


# --------------------------------------------------------------------------- estimators


def grpo(grouped: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
    """GRPO: the group mean is the baseline, ``scale`` the normaliser (the default estimator)."""
    return _scaled(grouped - grouped.mean(dim=1, keepdim=True), grouped, scale, eps)


def rloo(grouped: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
    """RLOO: the baseline of completion i is the mean of the other G − 1 rewards of its group
    (Kool et al. 2019; Ahmadian et al. 2024); ``scale: none`` is RLOO as published."""
    G = grouped.shape[1]
    if G < 2:
        raise RlttError("advantage 'rloo' needs group_size >= 2 (a leave-one-out baseline needs another sample)")
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (G - 1)
    return _scaled(grouped - others, grouped, scale, eps)


def reinforce_pp(grouped: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, the "-baseline" form for groups): subtract the group mean, then
    whiten over the whole batch, ``(x − mean_B x) / (std_B x + δ)``."""
    if scale != "batch":
        raise RlttError("advantage 'reinforce_pp' normalises over the batch: advantage_scale must be 'batch', "
                        f"got {scale!r}")
    x = grouped - grouped.mean(dim=1, keepdim=True)
    return (x - x.mean()) / (_std(x.flatten()).to(x) + eps)


#: name → estimator ``fn(grouped (n_groups, G), scale, eps) -> advantages (n_groups, G)``.
ADVANTAGE_ESTIMATORS: dict[str, Callable[[torch.Tensor, str, float], torch.Tensor]] = {
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
}
#: the ``advantage_scale`` values an estimator accepts (all, unless listed)
SCALES_OF: dict[str, tuple[str, ...]] = {"reinforce_pp": ("batch",)}


def _choice(field: str, value: str, allowed) -> None:
    if value not in allowed:
        raise RlttError(f"{field}: unknown value {value!r}; use one of {' | '.join(allowed)}")


# --------------------------------------------------------------------------- groups


def uniform_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool (n_groups,): true where every reward of the group is exactly equal.

    Such groups have zero group-relative advantage and carry no learning signal.
    """
    grouped = _grouped(rewards, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


@dataclass
class GroupAdvantages:
    """Result of :func:`group_advantages` (all detached).

    ``advantages`` (B,), ``uniform`` (n_groups,) bool, ``group_mean`` / ``group_std``
    (n_groups,) the per-group reward mean and sample std (before δ).
    """

    advantages: torch.Tensor
    uniform: torch.Tensor
    group_mean: torch.Tensor
    group_std: torch.Tensor

    @property
    def uniform_fraction(self) -> float:
        """Fraction of groups whose rewards are all equal (telemetry)."""
        return float(self.uniform.float().mean()) if self.uniform.numel() else 0.0


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: str = "group",
    eps: float = 1e-6,
    estimator: str = "grpo",
) -> GroupAdvantages:
    """Advantages of (B,) rewards by the ``estimator`` of :data:`ADVANTAGE_ESTIMATORS`; with the
    default ``grpo``::

        A_i = (r_i − mean_g r) / (std_g r + δ)      scale="group"
        A_i = (r_i − mean_g r) / (std_B r + δ)      scale="batch"   (std over the whole batch)
        A_i =  r_i − mean_g r                       scale="none"    (Dr. GRPO)

    with δ = ``eps`` and std the sample (Bessel-corrected) standard deviation, as in TRL and
    veRL (0 for a single element). Groups whose rewards are all equal get exactly zero
    advantage (not a rounding residue of r − mean).
    """
    _choice("advantage scale", scale, ADVANTAGE_SCALES)
    _choice("advantage estimator", estimator, tuple(ADVANTAGE_ESTIMATORS))
    if not rewards.dtype.is_floating_point:
        rewards = rewards.float()
    rewards = rewards.detach()
    grouped = _grouped(rewards, group_size)
    uniform = grouped.amax(dim=1) == grouped.amin(dim=1)
    mean = grouped.mean(dim=1)
    std = _std(grouped, 1)
    adv = ADVANTAGE_ESTIMATORS[estimator](grouped, scale, eps)
    adv = torch.where(uniform.unsqueeze(1), torch.zeros_like(adv), adv)
    return GroupAdvantages(advantages=adv.flatten(), uniform=uniform, group_mean=mean, group_std=std)


def _price_in_reward(rewards: torch.Tensor, price: torch.Tensor, group_size: int, scale: str,
                     estimator: str) -> torch.Tensor:
    """The advantages of ``rewards − price``: the price goes through the estimator and its normaliser."""
    return group_advantages(rewards - price, group_size, scale, estimator=estimator).advantages


def _price_in_advantage(rewards: torch.Tensor, price: torch.Tensor, group_size: int, scale: str,
                        estimator: str) -> torch.Tensor:
    """The advantages of ``rewards`` minus each row's ``price`` centred in its group, unscaled."""
    grouped = _grouped(price, group_size)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    return group_advantages(rewards, group_size, scale, estimator=estimator).advantages - centred


#: where a per-row price (``algorithm.compute_price``) enters the advantages: name ->
#: fn(rewards (B,), price (B,), group_size, scale, estimator) -> advantages (B,)
COMPUTE_PRICES = {"reward": _price_in_reward, "advantage": _price_in_advantage}
