"""RLTT / GRPO objectives (docs/design.md §5): group advantages, policy losses, aggregation, KL.

Batch layout: B = n_groups · G rows, the G completions of one prompt are consecutive rows
``[g*G : (g+1)*G]``. Per-token tensors are (B, S) over completion tokens with a (B, S) mask
(true/1 = a real completion token). Log-probs are whatever :func:`policy_logprob` returned
for the chosen definition (for RLTT's KL: the final-loop log-prob).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from rltt.errors import RlttError

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSS_KINDS",
    "GroupAdvantages",
    "PolicyLoss",
    "aggregate",
    "group_advantages",
    "kl_estimate",
    "policy_loss",
    "uniform_groups",
]

AdvantageScale = Literal["group", "batch", "none"]
PolicyLossKind = Literal["ppo_clip", "reinforce"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KlEstimator = Literal["k1", "k2", "k3"]
ADVANTAGE_SCALES = get_args(AdvantageScale)
POLICY_LOSS_KINDS = get_args(PolicyLossKind)
AGGREGATIONS = get_args(Aggregation)
KL_ESTIMATORS = get_args(KlEstimator)


def _choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise RlttError(f"{field}: unknown value {value!r}; use one of {' | '.join(allowed)}")


# --------------------------------------------------------------------------- groups


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) rewards → (n_groups, G) view, validating the layout."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise RlttError(f"group_size must be a positive integer, got {group_size!r}")
    if rewards.dim() != 1:
        raise RlttError(f"rewards must be a 1-D tensor (B,), got shape {tuple(rewards.shape)}")
    if rewards.shape[0] % group_size != 0:
        raise RlttError(f"batch of {rewards.shape[0]} rewards is not a whole number of groups of group_size={group_size}")
    return rewards.view(-1, group_size)


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
) -> GroupAdvantages:
    """Group-relative advantages (GRPO)::

        A_i = (r_i − mean_g r) / (std_g r + δ)      scale="group"
        A_i = (r_i − mean_g r) / (std_B r + δ)      scale="batch"   (std over the whole batch)
        A_i =  r_i − mean_g r                       scale="none"    (Dr. GRPO)

    with δ = ``eps`` and std the sample (Bessel-corrected) standard deviation, as in TRL and
    veRL (0 for a single element). Groups whose rewards are all equal get exactly zero
    advantage (not a rounding residue of r − mean).
    """
    _choice("advantage scale", scale, ADVANTAGE_SCALES)
    if not rewards.dtype.is_floating_point:
        rewards = rewards.float()
    rewards = rewards.detach()
    grouped = _grouped(rewards, group_size)
    uniform = grouped.amax(dim=1) == grouped.amin(dim=1)
    mean = grouped.mean(dim=1)
    std = grouped.std(dim=1) if group_size > 1 else torch.zeros_like(mean)
    centred = grouped - mean.unsqueeze(1)
    if scale == "group":
        adv = centred / (std.unsqueeze(1) + eps)
    elif scale == "batch":
        batch_std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        adv = centred / (batch_std + eps)
    else:
        adv = centred
    adv = torch.where(uniform.unsqueeze(1), torch.zeros_like(adv), adv)
    return GroupAdvantages(advantages=adv.flatten(), uniform=uniform, group_mean=mean, group_std=std)


# --------------------------------------------------------------------------- aggregation


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss (B, S) to a scalar over the unmasked tokens.

    - ``token_mean``: Σ_{b,j} x m / Σ_{b,j} m — every token weighs the same, so long
      completions weigh more (DAPO).
    - ``seq_mean_token_mean``: mean over sequences of (Σ_j x m / Σ_j m) — the original GRPO
      form; sequences with no unmasked token are left out of the mean.
    - ``seq_mean_token_sum_norm``: mean over all B sequences of Σ_j x m / ``max_len`` — Dr.
      GRPO's constant normaliser, no length bias. ``max_len`` defaults to S (the padded
      length); pass the generation budget to keep it constant across batches.

    Masked positions are ignored even if they hold inf/NaN. An all-masked batch gives 0.
    """
    _choice("loss aggregation", mode, AGGREGATIONS)
    if per_token.shape != mask.shape or per_token.dim() != 2:
        raise RlttError(f"aggregate: per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} must both be (B, S)")
    keep = mask.bool()
    x = torch.where(keep, per_token, torch.zeros_like(per_token))
    m = keep.to(per_token.dtype)
    if mode == "token_mean":
        return x.sum() / m.sum().clamp_min(1.0)
    token_sum = x.sum(dim=-1)
    if mode == "seq_mean_token_mean":
        token_count = m.sum(dim=-1)
        per_seq = token_sum / token_count.clamp_min(1.0)
        return per_seq.sum() / (token_count > 0).sum().clamp_min(1).to(per_token.dtype)
    norm = mask.shape[-1] if max_len is None else max_len
    if norm <= 0:
        raise RlttError(f"max_len must be positive for seq_mean_token_sum_norm, got {norm}")
    return (token_sum / norm).sum() / max(mask.shape[0], 1)


# --------------------------------------------------------------------------- policy loss


@dataclass
class PolicyLoss:
    """Result of :func:`policy_loss`. ``loss`` carries the gradient; the rest is detached.

    Fractions are over unmasked tokens. ``clip_low_fraction``: A < 0 and ratio < 1 − ε_low;
    ``clip_high_fraction``: A > 0 and ratio > 1 + ε_high (the tokens whose gradient PPO-clip
    zeroes); ``clip_fraction`` their sum. Ratio stats are of exp(logp − old_logp);
    ``approx_kl`` is the k3 estimate of KL(old ‖ new): mean of (ratio − 1) − log ratio.
    ``tis_weight_mean`` / ``tis_capped_fraction``: the truncated-IS weights (1 / 0 without TIS).
    """

    loss: torch.Tensor
    clip_fraction: torch.Tensor
    clip_low_fraction: torch.Tensor
    clip_high_fraction: torch.Tensor
    ratio_mean: torch.Tensor
    ratio_max: torch.Tensor
    ratio_min: torch.Tensor
    approx_kl: torch.Tensor
    tis_weight_mean: torch.Tensor
    tis_capped_fraction: torch.Tensor

    def as_dict(self) -> dict[str, float]:
        """Plain Python floats for logging."""
        return {name: float(getattr(self, name).detach()) for name in self.__dataclass_fields__}


def _masked_stats(values: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, max, min) of values over keep; (1, 1, 1) when nothing is kept (ratio default)."""
    if not bool(keep.any()):
        one = torch.ones((), dtype=values.dtype, device=values.device)
        return one, one, one
    selected = values[keep]
    return selected.mean(), selected.max(), selected.min()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str = "ppo_clip",
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    agg: str = "token_mean",
    max_len: int | None = None,
    tis_cap: float | None = None,
    behaviour_logp: torch.Tensor | None = None,
) -> PolicyLoss:
    """Policy-gradient loss over completion tokens.

    With ratio ρ = exp(logp − old_logp) and A the sequence advantage broadcast to its tokens:

    - ``ppo_clip`` (clip-higher, DAPO): ``ℓ = −min(ρ A, clip(ρ, 1 − ε_low, 1 + ε_high) A)``
    - ``reinforce`` (on-policy, RLTT's form): ``ℓ = −A · logp`` (``old_logp`` may be None;
      given, it only feeds the ratio statistics)

    Truncated importance sampling (sampler/learner mismatch): with ``tis_cap`` set, each
    token's ℓ is multiplied by ``sg(min(exp(old_logp − behaviour_logp), tis_cap))``, where
    ``behaviour_logp`` is the sampler's log-prob and ``old_logp`` the learner's at the rollout
    weights (for ``reinforce`` without old_logp: the current logp, detached).

    The loss is ``aggregate(ℓ, mask, agg, max_len)``. ``advantages`` is (B,) or per-token (B, S).
    """
    _choice("policy loss kind", kind, POLICY_LOSS_KINDS)
    _choice("loss aggregation", agg, AGGREGATIONS)
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise RlttError(f"policy_loss: logp {tuple(logp.shape)} and mask {tuple(mask.shape)} must both be (B, S)")
    if old_logp is not None and old_logp.shape != logp.shape:
        raise RlttError(f"policy_loss: old_logp shape {tuple(old_logp.shape)} != logp shape {tuple(logp.shape)}")
    if kind == "ppo_clip":
        if old_logp is None:
            raise RlttError("policy loss kind 'ppo_clip' needs old_logp")
        if not 0.0 <= eps_low < 1.0:
            raise RlttError(f"eps_low must be in [0, 1), got {eps_low}")
        if eps_high < 0.0:
            raise RlttError(f"eps_high must be >= 0, got {eps_high}")
    if advantages.shape == logp.shape[:1]:
        adv = advantages.detach().unsqueeze(-1)
    elif advantages.shape == logp.shape:
        adv = advantages.detach()
    else:
        raise RlttError(f"policy_loss: advantages shape {tuple(advantages.shape)} must be (B,) or (B, S) for logp {tuple(logp.shape)}")
    adv = adv.to(logp.dtype)
    keep = mask.bool()

    anchor = logp.detach() if old_logp is None else old_logp.detach()
    log_ratio = logp - anchor
    ratio = torch.exp(log_ratio)
    if kind == "ppo_clip":
        clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        per_token = torch.maximum(-adv * ratio, -adv * clipped)
    else:
        per_token = -adv * logp

    tis_weight = None
    if tis_cap is not None:
        if tis_cap <= 0:
            raise RlttError(f"tis_cap must be positive, got {tis_cap}")
        if behaviour_logp is None:
            raise RlttError("tis_cap is set but behaviour_logp (the sampler's log-probs) is missing")
        if behaviour_logp.shape != logp.shape:
            raise RlttError(f"policy_loss: behaviour_logp shape {tuple(behaviour_logp.shape)} != logp shape {tuple(logp.shape)}")
        tis_weight = torch.exp(anchor - behaviour_logp.detach()).clamp(max=tis_cap)
        per_token = per_token * tis_weight

    loss = aggregate(per_token, mask, agg, max_len)

    with torch.no_grad():
        count = keep.sum().clamp_min(1).to(logp.dtype)
        ratio_d = ratio.detach()
        if kind == "ppo_clip":
            low = keep & (adv < 0) & (ratio_d < 1.0 - eps_low)
            high = keep & (adv > 0) & (ratio_d > 1.0 + eps_high)
        else:
            low = high = torch.zeros_like(keep)
        low_frac, high_frac = low.sum() / count, high.sum() / count
        r_mean, r_max, r_min = _masked_stats(ratio_d, keep)
        approx_kl = torch.where(keep, (ratio_d - 1.0) - log_ratio.detach(), torch.zeros_like(ratio_d)).sum() / count
        if tis_weight is None:
            tis_mean = torch.ones((), dtype=logp.dtype, device=logp.device)
            tis_capped = torch.zeros((), dtype=logp.dtype, device=logp.device)
        else:
            tis_mean = torch.where(keep, tis_weight, torch.zeros_like(tis_weight)).sum() / count
            tis_capped = (keep & (tis_weight >= tis_cap)).sum() / count
        return PolicyLoss(
            loss=loss,
            clip_fraction=low_frac + high_frac,
            clip_low_fraction=low_frac,
            clip_high_fraction=high_frac,
            ratio_mean=r_mean,
            ratio_max=r_max,
            ratio_min=r_min,
            approx_kl=approx_kl,
            tis_weight_mean=tis_mean,
            tis_capped_fraction=tis_capped,
        )


# --------------------------------------------------------------------------- KL


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from tokens sampled from π (Schulman's k1/k2/k3).

    With d = logp − ref_logp:

    - ``k1`` = d                                  (unbiased, can be negative)
    - ``k2`` = ½ d²                               (biased, ≥ 0)
    - ``k3`` = exp(−d) − (−d) − 1 = exp(ref − logp) − (ref − logp) − 1   (unbiased, ≥ 0)
    """
    _choice("kl estimator", kind, KL_ESTIMATORS)
    if logp.shape != ref_logp.shape:
        raise RlttError(f"kl_estimate: logp shape {tuple(logp.shape)} != ref_logp shape {tuple(ref_logp.shape)}")
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    neg = -diff
    return torch.expm1(neg) - neg
