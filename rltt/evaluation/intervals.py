"""Standard errors and 95 % intervals of a benchmark mean, by a seeded bootstrap.

Scores come as an (S, P) array: S runs (training seeds, checkpoints or evaluation seeds of one
configuration) on the same P problems. The estimate is the grand mean. Each bootstrap replicate
draws P problems with replacement (one draw shared by every run, so a problem's difficulty stays
common to the runs) and — when S > 1 — S runs with replacement, independently of the problems:
a two-level bootstrap, so the interval counts the problems' variance and the between-run
(between-seed) variance. With S = 1 it is the ordinary bootstrap over problems. The standard
error is the replicates' standard deviation; the interval is their 2.5 / 97.5 % percentiles.

Resampling is expressed as multiplicity weights (a multinomial draw per replicate), so a
replicate's mean is one matrix product: memory O(B·P + B·S), not O(B·P·S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rltt.errors import RlttError

DEFAULT_REPS = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class Estimate:
    """A mean with its standard error and 95 % interval (an unbounded end is ±inf; null in JSON)."""

    mean: float
    se: float
    lo: float
    hi: float

    def to_dict(self) -> dict:
        bound = lambda x: x if math.isfinite(x) else None  # noqa: E731
        return {"mean": self.mean, "se": self.se, "ci95": [bound(self.lo), bound(self.hi)]}


def resample_weights(rng: np.random.Generator, size: int, reps: int) -> np.ndarray:
    """(reps, size) multiplicities of drawing ``size`` items with replacement, ``reps`` times."""
    if size == 1:
        return np.ones((reps, 1))
    return rng.multinomial(size, np.full(size, 1.0 / size), size=reps).astype(np.float64)


def as_runs(scores) -> np.ndarray:
    """``scores`` as an (S, P) float array (a 1-D array is one run)."""
    array = np.asarray(scores, dtype=np.float64)
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
        raise RlttError(f"bootstrap: expected scores of shape (runs, problems), got {array.shape}")
    return array


def replicate_means(scores, problem_w: np.ndarray, run_w: np.ndarray) -> np.ndarray:
    """Each replicate's weighted grand mean of (S, P) ``scores``: (B,) from (B, P) and (B, S) weights."""
    runs = as_runs(scores)
    per_run = problem_w @ runs.T / runs.shape[1]           # (B, S): each run's resampled problem mean
    return (per_run * run_w).sum(axis=1) / runs.shape[0]


def summarize(point: float, replicates: np.ndarray, level: float = LEVEL) -> Estimate:
    """``point`` with the replicates' standard deviation and percentile interval."""
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(replicates, [tail, 1.0 - tail])
    se = float(replicates.std(ddof=1)) if replicates.size > 1 else 0.0
    return Estimate(float(point), se, float(lo), float(hi))


def bootstrap_mean(scores, reps: int = DEFAULT_REPS, seed: int = 0, level: float = LEVEL) -> Estimate:
    """The grand mean of (S, P) ``scores`` (or one run's (P,)) with its two-level bootstrap SE and interval."""
    return bootstrap_means([scores], reps, seed, level)[0]


def bootstrap_means(score_sets, reps: int = DEFAULT_REPS, seed: int = 0, level: float = LEVEL) -> list[Estimate]:
    """`bootstrap_mean` of several (S, P) score arrays of the same runs and problems (e.g. pass@1 …
    pass@k) with the same replicates, so their intervals are jointly drawn and reproducible."""
    sets = [as_runs(s) for s in score_sets]
    if not sets:
        return []
    shape = sets[0].shape
    if any(s.shape != shape for s in sets):
        raise RlttError("bootstrap: every score array must have the same (runs, problems) shape")
    if reps < 2:
        raise RlttError(f"bootstrap: reps must be >= 2, got {reps}")
    rng = np.random.default_rng(seed)
    problem_w = resample_weights(rng, shape[1], reps)
    run_w = resample_weights(rng, shape[0], reps)
    return [summarize(s.mean(), replicate_means(s, problem_w, run_w), level) for s in sets]
