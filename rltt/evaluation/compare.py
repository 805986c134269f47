"""Paired comparison of two results on the same problems: A − B with its interval and a p-value.

``a`` (S_A, P) and ``b`` (S_B, P) are per-problem scores (e.g. pass@k) of S_A and S_B runs on the
same P problems, in the same order. The difference of grand means gets a two-level paired
bootstrap: every replicate draws one set of problems for both sides (the pairing: a problem's
difficulty cancels) and, independently per side, runs with replacement (the between-run variance).

Two tests of "A and B score the same":

- ``problems`` — sign-flip permutation over problems: under the null the per-problem difference
  ``d_i = mean_s a[s, i] − mean_s b[s, i]`` is symmetric about 0, so flipping the signs of the d_i at
  random gives the null distribution of their mean (all 2^P flips when that is at most
  ``permutations``, else random ones). Exact for one run a side; it does not count between-run
  variance.
- ``runs`` — permutation of whole runs between the sides: under the null every run is exchangeable,
  so the difference of the sides' mean run scores over all relabellings (every split when there
  are at most ``permutations``) is its null distribution. It counts the between-run variance and
  needs runs on both sides (with S_A = S_B = 3 the smallest two-sided p-value is 0.1).

``auto`` picks ``runs`` when both sides have at least two runs, else ``problems``. p-values are
two-sided: the fraction of the null distribution at least as far from 0 as the observed
difference (with the observed one counted when the flips are random draws).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from rltt.errors import RlttError
from rltt.evaluation.intervals import DEFAULT_REPS, LEVEL, Estimate, as_runs, replicate_means, resample_weights, \
    summarize

DEFAULT_PERMUTATIONS = 10_000
TESTS = ("auto", "problems", "runs")
_TIE = 1e-12  # a flipped mean this close to |observed| counts as "as extreme" (floating-point ties)


@dataclass(frozen=True)
class Difference:
    """A − B: the estimate with its interval, a two-sided p-value and which test gave it."""

    estimate: Estimate
    p_value: float
    test: str
    p_min: float  # the smallest p-value the test can give with these data

    def to_dict(self) -> dict:
        return {**self.estimate.to_dict(), "p_value": self.p_value, "test": self.test, "p_min": self.p_min}


def sign_flip_p(d, permutations: int = DEFAULT_PERMUTATIONS, seed: int = 0) -> tuple[float, float]:
    """Two-sided p-value (and the smallest attainable) of mean(d) = 0 by sign flips over the d_i."""
    d = np.asarray(d, dtype=np.float64)
    P = d.size
    observed = abs(d.mean())
    if P == 0:
        raise RlttError("paired test: no problems")
    if P <= math.floor(math.log2(permutations)):  # every sign vector: the exact null distribution
        signs = 1.0 - 2.0 * ((np.arange(2 ** P)[:, None] >> np.arange(P)[None, :]) & 1)
        means = np.abs(signs @ d) / P
        return float(np.mean(means >= observed - _TIE)), 2.0 / 2 ** P
    rng = np.random.default_rng(seed)
    hits, done, chunk = 0, 0, max(1, min(permutations, 4_000_000 // max(P, 1)))
    while done < permutations:
        m = min(chunk, permutations - done)
        signs = rng.integers(0, 2, size=(m, P), dtype=np.int8).astype(np.float64) * 2.0 - 1.0
        hits += int(np.sum(np.abs(signs @ d) / P >= observed - _TIE))
        done += m
    return (hits + 1) / (permutations + 1), 1.0 / (permutations + 1)


def run_permutation_p(run_a, run_b, permutations: int = DEFAULT_PERMUTATIONS, seed: int = 0) -> tuple[float, float]:
    """Two-sided p-value (and the smallest attainable) of equal means by permuting run labels."""
    ra, rb = np.asarray(run_a, dtype=np.float64), np.asarray(run_b, dtype=np.float64)
    pooled = np.concatenate([ra, rb])
    sa, total = ra.size, pooled.size
    observed = abs(ra.mean() - rb.mean())
    splits = math.comb(total, sa)
    if splits <= permutations:  # every relabelling
        stats = []
        for chosen in itertools.combinations(range(total), sa):
            mask = np.zeros(total, dtype=bool)
            mask[list(chosen)] = True
            stats.append(abs(pooled[mask].mean() - pooled[~mask].mean()))
        stats = np.asarray(stats)
        extreme = np.sum(stats >= observed - _TIE)
        return float(extreme / splits), float(np.sum(stats >= stats.max() - _TIE) / splits)
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random((permutations, total)), axis=1)
    shuffled = pooled[order]
    stats = np.abs(shuffled[:, :sa].mean(axis=1) - shuffled[:, sa:].mean(axis=1))
    return (int(np.sum(stats >= observed - _TIE)) + 1) / (permutations + 1), 1.0 / (permutations + 1)


def paired_difference(a, b, reps: int = DEFAULT_REPS, seed: int = 0, test: str = "auto",
                      permutations: int = DEFAULT_PERMUTATIONS, level: float = LEVEL) -> Difference:
    """A − B of (S_A, P) and (S_B, P) scores on the same problems (see the module docstring)."""
    return paired_differences([a], [b], reps, seed, test, permutations, level)[0]


def resolve_test(test: str, runs_a: int, runs_b: int) -> str:
    """The test ``auto`` means for these run counts (``runs`` needs two runs a side)."""
    if test not in TESTS:
        raise RlttError(f"--test: unknown test {test!r}; use one of {' | '.join(TESTS)}")
    if test == "auto":
        return "runs" if runs_a >= 2 and runs_b >= 2 else "problems"
    if test == "runs" and (runs_a < 1 or runs_b < 1 or runs_a + runs_b < 3):
        raise RlttError(f"--test runs: needs at least three runs in all (has {runs_a} + {runs_b})")
    return test


def paired_differences(a_sets, b_sets, reps: int = DEFAULT_REPS, seed: int = 0, test: str = "auto",
                       permutations: int = DEFAULT_PERMUTATIONS, level: float = LEVEL) -> list[Difference]:
    """`paired_difference` for several metrics (e.g. pass@1 … pass@k) with the same replicates."""
    a_sets, b_sets = [as_runs(x) for x in a_sets], [as_runs(x) for x in b_sets]
    if len(a_sets) != len(b_sets) or not a_sets:
        raise RlttError("paired test: A and B need the same metrics")
    sa, p = a_sets[0].shape
    sb, pb = b_sets[0].shape
    if p != pb or any(x.shape != (sa, p) for x in a_sets) or any(x.shape != (sb, p) for x in b_sets):
        raise RlttError(f"paired test: A has {p} problems and B {pb}; both need the same problems")
    if reps < 2:
        raise RlttError(f"bootstrap: reps must be >= 2, got {reps}")
    chosen = resolve_test(test, sa, sb)
    rng = np.random.default_rng(seed)
    problem_w = resample_weights(rng, p, reps)
    wa, wb = resample_weights(rng, sa, reps), resample_weights(rng, sb, reps)
    out = []
    for i, (x, y) in enumerate(zip(a_sets, b_sets)):
        replicates = replicate_means(x, problem_w, wa) - replicate_means(y, problem_w, wb)
        estimate = summarize(x.mean() - y.mean(), replicates, level)
        if chosen == "problems":
            pv, pmin = sign_flip_p(x.mean(axis=0) - y.mean(axis=0), permutations, seed + 1 + i)
        else:
            pv, pmin = run_permutation_p(x.mean(axis=1), y.mean(axis=1), permutations, seed + 1 + i)
        out.append(Difference(estimate, min(1.0, pv), chosen, pmin))
    return out
