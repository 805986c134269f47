"""Paired comparison of two results on the same problems: A − B with its standard error, interval
and p-value, every figure from one test.

``a`` (S_A, P) and ``b`` (S_B, P) are per-problem scores (e.g. pass@k) of S_A and S_B runs on the
same P problems, in the same order. The estimate is the difference of grand means. Two tests, each
with its own resampling unit; the standard error, the interval and the p-value of a comparison all
come from the one that is chosen, so they answer the same question:

- ``problems`` — sign flips over problems: under "A − B = δ" the per-problem difference
  ``d_i − δ`` (``d_i = mean_s a[s, i] − mean_s b[s, i]``) is symmetric about 0, so flipping the
  signs of the ``d_i − δ`` at random gives the null distribution of their mean (all 2^P flips when
  that is at most ``permutations``, else random ones). It asks how A − B varies over problems of
  the task, for these runs; it does not count between-run variance (exact for one run a side).
  Standard error: ``sd(d_i) / √P``.
- ``runs`` — permutation of whole runs between the sides: under "A − B = δ" the runs of A shifted
  by −δ and the runs of B are exchangeable, so the difference of the sides' mean run scores over
  all relabellings (every split when there are at most ``permutations``) is its null distribution.
  It asks how A − B varies over runs (training seeds) on these problems; it needs runs on both
  sides (with S_A = S_B = 3 the smallest two-sided p-value is 0.1). Standard error: Welch's
  ``√(s²_A / S_A + s²_B / S_B)`` of the runs' mean scores.

The p-value is the test of δ = 0; the interval inverts the test: every δ the test does not reject
at the level (p(δ) ≥ 1 − level), computed exactly for the same relabellings (each relabelling's
statistic is linear in δ, so whether it counts as extreme is a threshold in δ). The interval thus
excludes 0 exactly when p < 1 − level. When the test cannot reject at any δ (p_min ≥ 1 − level:
too few runs) the interval is unbounded. p-values are two-sided: the fraction of the null
distribution at least as far from 0 as the observed difference (with the observed one counted
when the relabellings are random draws).

``auto`` picks ``runs`` when both sides have at least two runs, else ``problems``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from rltt.errors import RlttError
from rltt.evaluation.intervals import LEVEL, Estimate, as_runs

DEFAULT_PERMUTATIONS = 10_000
TESTS = ("auto", "problems", "runs")
_TIE = 1e-12  # a relabelled statistic this close to |observed| counts as "as extreme" (floating-point ties)


@dataclass(frozen=True)
class Difference:
    """A − B: the estimate with its standard error and interval, a two-sided p-value and which test
    gave them (the interval is the inverted test: it excludes 0 exactly when p < 1 − level)."""

    estimate: Estimate
    p_value: float
    test: str
    p_min: float  # the smallest p-value the test can give with these data

    def to_dict(self) -> dict:
        return {**self.estimate.to_dict(), "p_value": self.p_value, "test": self.test, "p_min": self.p_min}


@dataclass(frozen=True)
class NullSet:
    """A permutation test's relabellings as lines in the hypothesised difference δ: under
    "A − B = δ" relabelling r gives the statistic ``stat[r] − slope[r]·δ`` (|slope| ≤ 1) and the
    data give ``observed − δ``. ``drawn``: random relabellings, the observed one counted once more."""

    stat: np.ndarray
    slope: np.ndarray
    observed: float
    drawn: bool
    p_min: float

    def _reach(self) -> tuple[np.ndarray, np.ndarray]:
        """How far above and below ``observed`` δ may go with relabelling r still as extreme as the
        data: r counts at δ = observed + u (u ≥ 0) iff u ≤ up[r], at observed − v iff v ≤ down[r]."""
        e, b = self.stat - self.slope * self.observed, self.slope
        up = np.maximum(_ratio(e + _TIE, 1.0 + b), _ratio(_TIE - e, 1.0 - b))
        down = np.maximum(_ratio(e + _TIE, 1.0 - b), _ratio(_TIE - e, 1.0 + b))
        return up, down

    def _needed(self, alpha: float) -> int:
        """Relabellings that must count for p(δ) ≥ alpha."""
        extra = int(self.drawn)
        return math.ceil(alpha * (self.stat.size + extra) - 1e-9) - extra

    def p_value(self, delta: float = 0.0) -> float:
        up, down = self._reach()
        u = delta - self.observed
        hits = int(np.sum(up >= u)) if u >= 0 else int(np.sum(down >= -u))
        extra = int(self.drawn)
        return min(1.0, (hits + extra) / (self.stat.size + extra))

    def interval(self, level: float = LEVEL) -> tuple[float, float]:
        """Every δ with p(δ) ≥ 1 − level: [observed − v*, observed + u*] (p is non-increasing away
        from the observed difference, so the set is an interval)."""
        k = self._needed(1.0 - level)
        if k <= 0:
            return -math.inf, math.inf
        up, down = self._reach()
        k = min(k, up.size)
        u = float(np.partition(up, up.size - k)[up.size - k])  # the k-th largest reach
        v = float(np.partition(down, down.size - k)[down.size - k])
        return self.observed - v, self.observed + u


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den for den ≥ 0; where den is 0 the condition ``0 ≤ num`` holds for every δ or none."""
    out = np.where(num >= 0, math.inf, -math.inf)
    ok = den > 1e-15
    np.divide(num, den, out=out, where=ok)
    return out


def sign_flip_null(d, permutations: int = DEFAULT_PERMUTATIONS, seed: int = 0) -> NullSet:
    """The sign-flip relabellings of per-problem differences ``d`` (every sign vector when 2^P ≤
    ``permutations``, else ``permutations`` random ones)."""
    d = np.asarray(d, dtype=np.float64)
    P = d.size
    if P == 0:
        raise RlttError("paired test: no problems")
    if P <= math.floor(math.log2(permutations)):  # every sign vector: the exact null distribution
        signs = 1.0 - 2.0 * ((np.arange(2 ** P)[:, None] >> np.arange(P)[None, :]) & 1)
        return NullSet(signs @ d / P, signs.sum(axis=1) / P, float(d.mean()), False, 2.0 / 2 ** P)
    rng = np.random.default_rng(seed)
    stats, slopes, done, chunk = [], [], 0, max(1, min(permutations, 4_000_000 // max(P, 1)))
    while done < permutations:
        m = min(chunk, permutations - done)
        signs = rng.integers(0, 2, size=(m, P), dtype=np.int8).astype(np.float64) * 2.0 - 1.0
        stats.append(signs @ d / P)
        slopes.append(signs.sum(axis=1) / P)
        done += m
    return NullSet(np.concatenate(stats), np.concatenate(slopes), float(d.mean()), True, 1.0 / (permutations + 1))


def run_permutation_null(run_a, run_b, permutations: int = DEFAULT_PERMUTATIONS, seed: int = 0) -> NullSet:
    """The relabellings of whole runs between the sides (every split when there are at most
    ``permutations``, else ``permutations`` random ones)."""
    ra, rb = np.asarray(run_a, dtype=np.float64), np.asarray(run_b, dtype=np.float64)
    pooled = np.concatenate([ra, rb])
    sa, total = ra.size, pooled.size
    sb = total - sa
    splits = math.comb(total, sa)
    if splits <= permutations:  # every relabelling
        chosen = np.zeros((splits, total), dtype=bool)
        for row, members in enumerate(itertools.combinations(range(total), sa)):
            chosen[row, list(members)] = True
    else:
        rng = np.random.default_rng(seed)
        order = np.argsort(rng.random((permutations, total)), axis=1)
        chosen = np.zeros((permutations, total), dtype=bool)
        np.put_along_axis(chosen, order[:, :sa], True, axis=1)
    stat = chosen @ pooled / sa - (~chosen) @ pooled / sb
    from_a = chosen[:, :sa].sum(axis=1)  # A's runs on the A side of the relabelling: each carries −δ
    slope = from_a / sa - (sa - from_a) / sb
    observed = float(ra.mean() - rb.mean())
    if splits <= permutations:
        extreme = np.abs(stat)
        p_min = float(np.sum(extreme >= extreme.max() - _TIE) / splits)
        return NullSet(stat, slope, observed, False, p_min)
    return NullSet(stat, slope, observed, True, 1.0 / (permutations + 1))


def sign_flip_p(d, permutations: int = DEFAULT_PERMUTATIONS, seed: int = 0) -> tuple[float, float]:
    """Two-sided p-value (and the smallest attainable) of mean(d) = 0 by sign flips over the d_i."""
    null = sign_flip_null(d, permutations, seed)
    return null.p_value(), null.p_min


def run_permutation_p(run_a, run_b, permutations: int = DEFAULT_PERMUTATIONS, seed: int = 0) -> tuple[float, float]:
    """Two-sided p-value (and the smallest attainable) of equal means by permuting run labels."""
    null = run_permutation_null(run_a, run_b, permutations, seed)
    return null.p_value(), null.p_min


def problems_se(d) -> float:
    """Standard error of mean(d) over problems: sd(d_i) / √P (0 for one problem)."""
    d = np.asarray(d, dtype=np.float64)
    return float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else 0.0


def runs_se(run_a, run_b) -> float:
    """Welch's standard error of mean(run_a) − mean(run_b) over runs (a side of one run adds 0)."""
    var = lambda r: float(np.var(r, ddof=1)) / r.size if r.size > 1 else 0.0  # noqa: E731
    return math.sqrt(var(np.asarray(run_a, dtype=np.float64)) + var(np.asarray(run_b, dtype=np.float64)))


def _problems(x: np.ndarray, y: np.ndarray, permutations: int, seed: int) -> tuple[NullSet, float]:
    d = x.mean(axis=0) - y.mean(axis=0)
    return sign_flip_null(d, permutations, seed), problems_se(d)


def _runs(x: np.ndarray, y: np.ndarray, permutations: int, seed: int) -> tuple[NullSet, float]:
    ra, rb = x.mean(axis=1), y.mean(axis=1)
    return run_permutation_null(ra, rb, permutations, seed), runs_se(ra, rb)


#: test name -> (A's (S_A, P) scores, B's, permutations, seed) -> its null set and standard error
TEST_UNITS = {"problems": _problems, "runs": _runs}


def paired_difference(a, b, seed: int = 0, test: str = "auto", permutations: int = DEFAULT_PERMUTATIONS,
                      level: float = LEVEL) -> Difference:
    """A − B of (S_A, P) and (S_B, P) scores on the same problems (see the module docstring)."""
    return paired_differences([a], [b], seed, test, permutations, level)[0]


def resolve_test(test: str, runs_a: int, runs_b: int) -> str:
    """The test ``auto`` means for these run counts (``runs`` needs two runs a side)."""
    if test not in TESTS:
        raise RlttError(f"--test: unknown test {test!r}; use one of {' | '.join(TESTS)}")
    if test == "auto":
        return "runs" if runs_a >= 2 and runs_b >= 2 else "problems"
    if test == "runs" and (runs_a < 1 or runs_b < 1 or runs_a + runs_b < 3):
        raise RlttError(f"--test runs: needs at least three runs in all (has {runs_a} + {runs_b})")
    return test


def paired_differences(a_sets, b_sets, seed: int = 0, test: str = "auto", permutations: int = DEFAULT_PERMUTATIONS,
                       level: float = LEVEL) -> list[Difference]:
    """`paired_difference` for several metrics (e.g. pass@1 … pass@k), each with its own relabellings."""
    a_sets, b_sets = [as_runs(x) for x in a_sets], [as_runs(x) for x in b_sets]
    if len(a_sets) != len(b_sets) or not a_sets:
        raise RlttError("paired test: A and B need the same metrics")
    sa, p = a_sets[0].shape
    sb, pb = b_sets[0].shape
    if p != pb or any(x.shape != (sa, p) for x in a_sets) or any(x.shape != (sb, p) for x in b_sets):
        raise RlttError(f"paired test: A has {p} problems and B {pb}; both need the same problems")
    if not 0.0 < level < 1.0:
        raise RlttError(f"paired test: level must be in (0, 1), got {level}")
    chosen = resolve_test(test, sa, sb)
    out = []
    for i, (x, y) in enumerate(zip(a_sets, b_sets)):
        null, se = TEST_UNITS[chosen](x, y, permutations, seed + 1 + i)
        lo, hi = null.interval(level)
        estimate = Estimate(float(x.mean() - y.mean()), se, lo, hi)
        out.append(Difference(estimate, null.p_value(), chosen, null.p_min))
    return out
