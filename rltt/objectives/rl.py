"""RLTT / GRPO objectives (docs/design.md §5): group advantages, policy losses, aggregation, KL.

Batch layout: B = n_groups · G rows, the G completions of one prompt are consecutive rows
``[g*G : (g+1)*G]``. Per-token tensors are (B, S) over completion tokens with a (B, S) mask
(true/1 = a real completion token). Log-probs are whatever :func:`policy_logprob` returned
for the chosen definition (for RLTT's KL: the final-loop log-prob).

The menus are tables, one module each: advantage estimators
(:mod:`rltt.objectives.advantages`), policy losses (:mod:`rltt.objectives.policy_losses`) and
rollout corrections (:mod:`rltt.objectives.corrections`); this module composes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from rltt.errors import RlttError
from rltt.objectives.advantages import (ADVANTAGE_ESTIMATORS, ADVANTAGE_SCALES, AdvantageScale, GroupAdvantages,
                                        group_advantages, uniform_groups)
from rltt.objectives.corrections import CORRECTIONS, CorrectionParams, correction_weights
from rltt.objectives.policy_losses import POLICY_LOSSES, PolicyLossKind

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSS_KINDS",
    "AdvantageScale",
    "GroupAdvantages",
    "PolicyLoss",
    "PolicyLossKind",
    "aggregate",
    "group_advantages",
    "kl_estimate",
    "policy_loss",
    "uniform_groups",
]

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KlEstimator = Literal["k1", "k2", "k3"]
POLICY_LOSS_KINDS = tuple(POLICY_LOSSES)
AGGREGATIONS = get_args(Aggregation)
KL_ESTIMATORS = get_args(KlEstimator)


def _choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise RlttError(f"{field}: unknown value {value!r}; use one of {' | '.join(allowed)}")


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

    Fractions are over unmasked tokens. ``clip_low_fraction`` / ``clip_high_fraction``: the
    tokens whose gradient the loss's clip removed (PPO-clip: A < 0 and ratio < 1 − ε_low, A > 0
    and ratio > 1 + ε_high; GSPO: the same on the sequence ratio, counted per token; CISPO: the
    tokens whose weight was capped — their gradient is kept); ``clip_fraction`` their sum. Ratio
    stats are of the token ratio exp(logp − old_logp); ``approx_kl`` is the k3 estimate of
    KL(old ‖ new): mean of (ratio − 1) − log ratio.
    ``tis_weight_mean`` / ``tis_capped_fraction``: the rollout-correction weights over the tokens
    it kept (1) and the share a truncation capped (0) — 1 / 0 without a correction.
    ``correction_*``: sums and the max over this batch for the learner to combine exactly across
    micro-batches: completion tokens, tokens a mask rejected, Σ weight over the kept tokens, max weight.
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
    correction_tokens: torch.Tensor
    correction_masked: torch.Tensor
    correction_weight_sum: torch.Tensor
    correction_weight_max: torch.Tensor

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
    eps_low: float | None = None,
    eps_high: float | None = None,
    agg: str = "token_mean",
    max_len: int | None = None,
    tis_cap: float | None = None,
    behaviour_logp: torch.Tensor | None = None,
    correction: str = "none",
    correction_params: CorrectionParams | None = None,
    rollout_logp: torch.Tensor | None = None,
) -> PolicyLoss:
    """Policy-gradient loss over completion tokens: ``aggregate(c · ℓ, mask, agg, max_len)``.

    ℓ is the per-token loss of ``kind`` (:data:`rltt.objectives.policy_losses.POLICY_LOSSES`:
    ``ppo_clip``, ``reinforce``, ``gspo``, ``cispo``) with the ratio ρ = exp(logp − old_logp) and
    A the sequence advantage broadcast to its tokens; ``eps_low`` / ``eps_high`` are that loss's
    clip range (None: its default — PPO-clip 0.2 / 0.28, GSPO 3e-4 / 4e-4, CISPO none / 3).
    ``reinforce`` needs no ``old_logp`` (given, it only feeds the ratio statistics).

    c is the rollout ``correction``'s stop-gradient weight
    (:data:`rltt.objectives.corrections.CORRECTIONS`) from ``rollout_logp`` — the learner's
    log-prob at the rollout weights (default: ``old_logp``, for ``reinforce`` without it the
    current logp, detached) — and ``behaviour_logp``, the sampler's, with the cap and band of
    ``correction_params``. ``tis_cap`` is the alias of ``correction="token_tis"`` with that cap.
    Tokens a correction masks contribute exactly nothing (they are also left out of GSPO's
    sequence ratio) and still count in the normaliser. ``advantages`` is (B,) or per-token (B, S).
    """
    _choice("policy loss kind", kind, POLICY_LOSS_KINDS)
    _choice("loss aggregation", agg, AGGREGATIONS)
    _choice("rollout correction", correction, tuple(CORRECTIONS))
    spec = POLICY_LOSSES[kind]
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise RlttError(f"policy_loss: logp {tuple(logp.shape)} and mask {tuple(mask.shape)} must both be (B, S)")
    if old_logp is not None and old_logp.shape != logp.shape:
        raise RlttError(f"policy_loss: old_logp shape {tuple(old_logp.shape)} != logp shape {tuple(logp.shape)}")
    if spec.needs_old and old_logp is None:
        raise RlttError(f"policy loss kind {kind!r} needs old_logp")
    if advantages.shape == logp.shape[:1]:
        adv = advantages.detach().unsqueeze(-1)
    elif advantages.shape == logp.shape:
        adv = advantages.detach()
    else:
        raise RlttError(f"policy_loss: advantages shape {tuple(advantages.shape)} must be (B,) or (B, S) for logp {tuple(logp.shape)}")
    adv = adv.to(logp.dtype)
    keep = mask.bool()

    anchor = logp.detach() if old_logp is None else old_logp.detach()
    params = correction_params or CorrectionParams()
    if tis_cap is not None:
        if tis_cap <= 0:
            raise RlttError(f"tis_cap must be positive, got {tis_cap}")
        if correction not in ("none", "token_tis"):
            raise RlttError(f"tis_cap is the token_tis correction; it cannot be combined with correction "
                            f"{correction!r}")
        correction, params = "token_tis", CorrectionParams(tis_cap, params.lo, params.hi, params.decoupled_cap)
    weights, active = None, keep
    if correction != "none":
        if behaviour_logp is None:
            raise RlttError(f"rollout correction {correction!r} needs behaviour_logp (the sampler's log-probs)")
        if behaviour_logp.shape != logp.shape:
            raise RlttError(f"policy_loss: behaviour_logp shape {tuple(behaviour_logp.shape)} != logp shape {tuple(logp.shape)}")
        learner = anchor if rollout_logp is None else rollout_logp.detach()
        weights = correction_weights(correction, learner, behaviour_logp, keep, params)
        active = keep & ~weights.masked  # a masked token is out of the loss, GSPO's sequence ratio included

    low_eps = spec.defaults[0] if eps_low is None else eps_low
    high_eps = spec.defaults[1] if eps_high is None else eps_high
    terms = spec.fn(logp, anchor, adv, active, low_eps, high_eps)
    per_token = terms.per_token
    if weights is not None:  # a masked token contributes nothing, even where its ℓ is not finite
        per_token = torch.where(active, per_token * weights.weight, torch.zeros_like(per_token))

    loss = aggregate(per_token, mask, agg, max_len)

    with torch.no_grad():
        count = keep.sum().clamp_min(1).to(logp.dtype)
        log_ratio = (logp - anchor).detach()
        ratio_d = torch.exp(log_ratio)
        low, high = terms.clipped_low & keep, terms.clipped_high & keep
        low_frac, high_frac = low.sum() / count, high.sum() / count
        r_mean, r_max, r_min = _masked_stats(ratio_d, keep)
        approx_kl = torch.where(keep, (ratio_d - 1.0) - log_ratio, torch.zeros_like(ratio_d)).sum() / count
        tokens = keep.sum().to(logp.dtype)
        if weights is None:
            one = torch.ones((), dtype=logp.dtype, device=logp.device)
            tis_mean, tis_capped, masked, w_sum, w_max = one, 0 * one, 0 * one, tokens, one
        else:
            kept = keep & ~weights.masked
            w = torch.where(kept, weights.weight, torch.zeros_like(weights.weight))
            masked = weights.masked.sum().to(logp.dtype)
            w_sum = w.sum().to(logp.dtype)
            tis_mean = w_sum / kept.sum().clamp_min(1).to(logp.dtype)
            tis_capped = (weights.capped & keep).sum() / count
            w_max = w.max().to(logp.dtype)  # 0 when every token was masked
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
            correction_tokens=tokens,
            correction_masked=masked,
            correction_weight_sum=w_sum,
            correction_weight_max=w_max,
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
