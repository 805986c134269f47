"""The paired test: p-values uniform under the null on simulated data, small under a real
difference; the run permutation stays calibrated where run effects fool a per-problem test."""

import numpy as np
import pytest

from rltt.errors import RlttError
from rltt.evaluation.compare import paired_difference, run_permutation_p, sign_flip_p
from rltt.evaluation.passk import pass_at_k


def ks_uniform(p: np.ndarray) -> float:
    """Kolmogorov–Smirnov distance of the p-values from U(0, 1)."""
    p = np.sort(p)
    grid = np.arange(1, p.size + 1) / p.size
    return float(max(np.max(grid - p), np.max(p - (grid - 1 / p.size))))


def simulate_pair(rng, problems, samples, shift=0.0):
    q = rng.beta(0.6, 0.9, problems)
    ca = rng.binomial(samples, np.clip(q + shift, 0, 1))
    cb = rng.binomial(samples, q)
    n = np.full(problems, samples)
    return pass_at_k(n, ca, 1), pass_at_k(n, cb, 1)


def test_sign_flip_p_values_are_uniform_under_the_null():
    rng = np.random.default_rng(7)
    p = np.array([paired_difference(*simulate_pair(rng, 100, 16), seed=i, permutations=999).p_value
                  for i in range(300)])
    assert 0.02 <= np.mean(p < 0.05) <= 0.09, np.mean(p < 0.05)
    assert 0.38 <= np.mean(p < 0.5) <= 0.58, np.mean(p < 0.5)
    assert ks_uniform(p) < 0.1, ks_uniform(p)


def test_sign_flip_stays_valid_on_coarse_data():
    """Few samples a problem make the differences coarse (ties, a mean of exactly 0): the test is
    then conservative — never more rejections than the level."""
    rng = np.random.default_rng(17)
    p = np.array([paired_difference(*simulate_pair(rng, 40, 2), seed=i, permutations=499).p_value
                  for i in range(300)])
    assert np.mean(p < 0.05) <= 0.08 and np.mean(p < 0.5) <= 0.55


def test_sign_flip_p_values_are_small_under_a_real_difference():
    rng = np.random.default_rng(8)
    results = [paired_difference(*simulate_pair(rng, 100, 4, shift=0.15), seed=i, permutations=999)
               for i in range(20)]
    assert np.median([r.p_value for r in results]) < 0.01
    assert all(r.test == "problems" and r.estimate.mean > 0 for r in results)
    assert np.mean([r.estimate.lo > 0 for r in results]) >= 0.8


def test_exact_sign_flip_on_few_problems():
    # 3 problems all favour A: of the 8 sign vectors only all-plus and all-minus reach |mean| = 1
    p, p_min = sign_flip_p([1.0, 1.0, 1.0])
    assert p == pytest.approx(2 / 8) and p_min == pytest.approx(2 / 8)
    assert sign_flip_p([0.0, 0.0])[0] == 1.0


def test_run_permutation_is_calibrated_where_run_effects_fool_the_per_problem_test():
    """Each run (a training seed) shifts all its problems: same configuration on both sides, so
    the null holds, but the problems test sees the run effects as a difference."""
    rng = np.random.default_rng(9)
    p_runs, p_problems = [], []
    for i in range(200):
        q = rng.normal(0.5, 0.2, 80)
        a = q[None, :] + rng.normal(0, 0.05, (4, 1)) + rng.normal(0, 0.05, (4, 80))
        b = q[None, :] + rng.normal(0, 0.05, (4, 1)) + rng.normal(0, 0.05, (4, 80))
        runs = paired_difference(a, b, seed=i)
        assert runs.test == "runs" and runs.p_min == pytest.approx(2 / 70)
        p_runs.append(runs.p_value)
        p_problems.append(paired_difference(a, b, seed=i, test="problems", permutations=499).p_value)
    p_runs = np.array(p_runs)
    assert 0.01 <= np.mean(p_runs < 0.05) <= 0.10 and 0.38 <= np.mean(p_runs < 0.5) <= 0.62
    assert np.mean(np.array(p_problems) < 0.05) > 0.3  # anti-conservative: why auto picks the runs test


def test_run_permutation_exact_and_random_agree():
    rng = np.random.default_rng(1)
    a, b = rng.normal(0.3, 0.1, 6), rng.normal(0.5, 0.1, 6)
    exact, _ = run_permutation_p(a, b, permutations=10_000)  # C(12, 6) = 924 splits: enumerated
    drawn, _ = run_permutation_p(a, b, permutations=500, seed=2)  # fewer than the splits: random
    assert abs(exact - drawn) < 0.02 and exact < 0.05


def test_mismatched_inputs_are_errors():
    with pytest.raises(RlttError, match="same problems"):
        paired_difference(np.zeros(3), np.zeros(4))
    with pytest.raises(RlttError, match="--test"):
        paired_difference(np.zeros(3), np.zeros(3), test="wilcoxon")
    with pytest.raises(RlttError, match="three runs"):
        paired_difference(np.zeros(3), np.zeros(3), test="runs")


@pytest.mark.parametrize("test", ["problems", "runs"])
def test_the_interval_is_the_inverted_test(test):
    """Every δ inside the interval: the test of "A − B = δ" (A's scores shifted by −δ, the p-value
    computed afresh) does not reject; just outside it, it does."""
    rng = np.random.default_rng(3)
    runs = 1 if test == "problems" else 6
    a, b = rng.normal(0.55, 0.2, (runs, 60)), rng.normal(0.5, 0.2, (runs, 60))
    a += rng.normal(0, 0.03, (runs, 1))
    d = paired_difference(a, b, test=test, permutations=999)
    lo, hi = d.estimate.lo, d.estimate.hi
    assert lo < d.estimate.mean < hi

    def p_at(delta):
        shifted = a - delta
        if test == "problems":
            return sign_flip_p(shifted.mean(axis=0) - b.mean(axis=0), 999, seed=1)[0]
        return run_permutation_p(shifted.mean(axis=1), b.mean(axis=1), 999, seed=1)[0]

    width = hi - lo
    for delta in np.linspace(lo, hi, 7)[1:-1]:
        assert p_at(delta) >= 0.05
    assert p_at(lo + 1e-9 * width) >= 0.05 and p_at(hi - 1e-9 * width) >= 0.05
    assert p_at(lo - 1e-6 * width) < 0.05 and p_at(hi + 1e-6 * width) < 0.05
    assert p_at(0.0) == pytest.approx(d.p_value)


def test_too_few_runs_give_an_unbounded_interval():
    """With 3 + 3 runs the runs test cannot reach p < 0.05, so no δ is excluded: the interval is
    unbounded (null in JSON), however far apart the sides are."""
    a, b = np.full((3, 5), 0.9), np.full((3, 5), 0.1)
    a[:, 0] += [0.01, 0.02, 0.03]
    d = paired_difference(a, b)
    assert d.test == "runs" and d.p_value == pytest.approx(0.1) and d.p_min == pytest.approx(0.1)
    assert d.estimate.lo == -np.inf and d.estimate.hi == np.inf
    assert d.to_dict()["ci95"] == [None, None] and d.estimate.se > 0
