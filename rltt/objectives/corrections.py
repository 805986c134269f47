"""Rollout corrections (docs/design.md §5.6): reweighting or masking tokens by how far the
learner's log-prob at the rollout weights is from the sampler's — the table the recipe's
``algorithm.correction`` names.

With δ_j = logp_learner(θ_rollout)_j − logp_sampler_j over a sequence's completion tokens,
w_j = exp(δ_j) the token ratio, W = exp(Σ_j δ_j) the sequence ratio and
Ḡ = exp(mean_j δ_j) its geometric mean per token, each correction gives every token a
stop-gradient weight c_j that multiplies its loss:

- ``none``:       c_j = 1
- ``token_tis``:  c_j = min(w_j, C)                       (truncated IS; ``tis_cap`` is its alias)
- ``seq_tis``:    c_j = min(W, C)
- ``token_mask``: c_j = w_j · 1[lo ≤ w_j ≤ hi]           (masked IS, IcePop)
- ``seq_mask``:   c_j = W · 1[lo ≤ W ≤ hi]
- ``geo_mask``:   c_j = 1[lo ≤ Ḡ ≤ hi]                    (rejects whole sequences, no reweighting)
- ``decoupled``:  c_j = w_j · 1[w_j ≤ C_d]                 (decoupled PPO, AReaL)

with C = ``correction_cap``, [lo, hi] = [``correction_lo``, ``correction_hi``] and C_d =
``decoupled_cap``. ``decoupled`` is the behaviour weight of AReaL's decoupled PPO: the learner's
log-prob it compares is the proximal policy's (the learner's weights at the step's start, which is
what the loss's ratio is clipped against), so c_j = π_prox/π_behav and the loss is
−c_j · min(ρ_j A, clip(ρ_j) A) with ρ_j = π_θ/π_prox; a token whose weight exceeds C_d is masked
(AReaL's ``behav_imp_weight_cap``), not truncated. A masked token
(c_j = 0 by a mask) contributes exactly nothing to the loss or the gradient and still counts in
the aggregation's normaliser (IcePop's form), so micro-batch weighting is unchanged. The band
tests are made in log space, and a sequence ratio that overflows is capped or masked. A new
correction is one function and one line of :data:`CORRECTIONS`.

Mixed versions (``orchestration.partial_rollouts``, docs/async.md): a row's tokens may have been
sampled with different weights versions (``LearnerBatch.versions``). ``sampler_logp`` holds each
token's log-prob under the version that sampled it, so δ_j — and every weight above — is per token
against that token's own behaviour policy, and a sequence ratio W = Π_j w_j is the ratio to the
probability with which the sequence was actually sampled (each token under its own version);
nothing here depends on the versions themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from rltt.errors import RlttError

__all__ = ["CORRECTIONS", "CorrectionKind", "CorrectionParams", "CorrectionWeights", "correction_weights"]


@dataclass(frozen=True)
class CorrectionParams:
    """C (``cap``) for the truncations, [``lo``, ``hi``] for the masks, C_d (``decoupled_cap``)
    for the decoupled objective's behaviour weight."""

    cap: float = 2.0
    lo: float = 0.5
    hi: float = 5.0
    decoupled_cap: float = 5.0

    def check(self) -> None:
        if not self.cap > 0:
            raise RlttError(f"correction cap must be positive, got {self.cap}")
        if not self.decoupled_cap > 0:
            raise RlttError(f"decoupled cap must be positive, got {self.decoupled_cap}")
        if not 0 <= self.lo < self.hi:
            raise RlttError(f"correction band must satisfy 0 <= lo < hi, got lo={self.lo}, hi={self.hi}")


@dataclass
class CorrectionWeights:
    """``weight`` c (B, S), detached, 0 where ``masked``; ``masked`` (B, S) bool: kept tokens a mask
    rejected; ``capped`` (B, S) bool: tokens whose weight a truncation lowered to C."""

    weight: torch.Tensor
    masked: torch.Tensor
    capped: torch.Tensor


def _seq_sum(delta: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """(B, 1) Σ_j δ_j over each sequence's kept tokens."""
    return torch.where(keep, delta, torch.zeros_like(delta)).sum(-1, keepdim=True)


def _band(log_value: torch.Tensor, p: CorrectionParams) -> torch.Tensor:
    """lo ≤ exp(log_value) ≤ hi, in log space (lo = 0 has no lower edge)."""
    low = torch.ones_like(log_value, dtype=torch.bool) if p.lo == 0 else log_value >= math.log(p.lo)
    return low & (log_value <= math.log(p.hi))


def _result(keep: torch.Tensor, weight: torch.Tensor, inside: torch.Tensor | None = None,
            capped: torch.Tensor | None = None) -> CorrectionWeights:
    inside = torch.ones_like(keep) if inside is None else inside.expand_as(keep)
    weight = torch.where(keep & inside, weight.expand_as(keep), torch.zeros_like(weight.expand_as(keep)))
    capped = torch.zeros_like(keep) if capped is None else keep & capped.expand_as(keep)
    return CorrectionWeights(weight, keep & ~inside, capped)


def no_correction(delta, keep, p: CorrectionParams) -> CorrectionWeights:
    return _result(keep, torch.ones_like(delta))


def token_tis(delta, keep, p: CorrectionParams) -> CorrectionWeights:
    weight = torch.exp(delta).clamp(max=p.cap)
    return _result(keep, weight, capped=weight >= p.cap)


def seq_tis(delta, keep, p: CorrectionParams) -> CorrectionWeights:
    weight = torch.exp(_seq_sum(delta, keep)).clamp(max=p.cap)  # an overflow to inf is capped
    return _result(keep, weight, capped=weight >= p.cap)


def token_mask(delta, keep, p: CorrectionParams) -> CorrectionWeights:
    return _result(keep, torch.exp(delta), _band(delta, p))


def seq_mask(delta, keep, p: CorrectionParams) -> CorrectionWeights:
    total = _seq_sum(delta, keep)
    return _result(keep, torch.exp(total), _band(total, p))  # out of the band (or inf): weight 0


def geo_mask(delta, keep, p: CorrectionParams) -> CorrectionWeights:
    mean = _seq_sum(delta, keep) / keep.sum(-1, keepdim=True).clamp_min(1).to(delta.dtype)
    return _result(keep, torch.ones_like(mean), _band(mean, p))


def decoupled(delta, keep, p: CorrectionParams) -> CorrectionWeights:
    """π_prox/π_behav per token, 0 (masked) above ``decoupled_cap`` (AReaL's decoupled PPO)."""
    return _result(keep, torch.exp(delta), delta <= math.log(p.decoupled_cap))


#: name → ``fn(delta (B, S), keep (B, S) bool, params) -> CorrectionWeights``.
CORRECTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, CorrectionParams], CorrectionWeights]] = {
    "none": no_correction,
    "token_tis": token_tis,
    "seq_tis": seq_tis,
    "token_mask": token_mask,
    "seq_mask": seq_mask,
    "geo_mask": geo_mask,
    "decoupled": decoupled,
}

CorrectionKind = Literal[tuple(CORRECTIONS)]  # type: ignore[valid-type]  # the table's names


def correction_weights(kind: str, learner_logp: torch.Tensor, sampler_logp: torch.Tensor, keep: torch.Tensor,
                       params: CorrectionParams = CorrectionParams()) -> CorrectionWeights:
    """The ``kind`` correction's weights from the learner's log-probs at the rollout weights and the
    sampler's, both (B, S) and detached here; ``keep`` the (B, S) completion-token mask."""
    if kind not in CORRECTIONS:
        raise RlttError(f"rollout correction: unknown value {kind!r}; use one of {' | '.join(CORRECTIONS)}")
    if learner_logp.shape != sampler_logp.shape or keep.shape != learner_logp.shape:
        raise RlttError(f"rollout correction: learner {tuple(learner_logp.shape)}, sampler "
                        f"{tuple(sampler_logp.shape)} and mask {tuple(keep.shape)} log-probs must share a shape")
    params.check()
    keep = keep.bool()
    delta = torch.where(keep, learner_logp.detach() - sampler_logp.detach(), torch.zeros_like(learner_logp))
    return CORRECTIONS[kind](delta, keep, params)
