"""The pass@k estimator against brute-force enumeration of k-subsets, and its edge cases."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.errors import RlttError
from rltt.evaluation.passk import mean_at_k, pass_at_k, problem_scores


def brute_force(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_enumeration_over_every_k_subset(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_matches_the_binomial_formula_and_edge_cases(nck):
    n, c, k = nck
    got = float(pass_at_k(n, c, k))
    assert got == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    assert 0.0 <= got <= 1.0
    if c == 0:
        assert got == 0.0
    if c == n or n - c < k:  # every k-subset holds a correct sample (k = n: any correct one)
        assert got == 1.0
    if k == 1:
        assert got == pytest.approx(c / n, abs=1e-12)
    if k < n:  # more draws never lower it
        assert float(pass_at_k(n, c, k + 1)) >= got - 1e-12


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))), min_size=1,
                max_size=20))
def test_vectorised_equals_scalar(rows):
    n = np.array([r[0] for r in rows])
    c = np.array([r[1] for r in rows])
    k = int(n.min())
    scores = problem_scores(n, c, list(range(1, k + 1)))
    assert scores.shape == (k, len(rows))
    for j, (ni, ci) in enumerate(rows):
        for kk in range(1, k + 1):
            assert scores[kk - 1, j] == pytest.approx(1 - math.comb(ni - ci, kk) / math.comb(ni, kk), abs=1e-12)
    np.testing.assert_allclose(mean_at_k(n, c), c / n)


def test_large_n_is_stable():
    # C(5000, 10) overflows float64 arithmetic on factorials; the product form stays exact
    assert float(pass_at_k(5000, 1, 10)) == pytest.approx(10 / 5000, rel=1e-12)
    assert float(pass_at_k(5000, 4999, 10)) == 1.0
    got = float(pass_at_k(2000, 1000, 50))
    assert got == pytest.approx(1 - math.comb(1000, 50) / math.comb(2000, 50), rel=1e-12)


def test_bad_inputs_are_errors():
    with pytest.raises(RlttError, match="exceeds"):
        pass_at_k([4, 2], [1, 1], 3)
    with pytest.raises(RlttError, match=r"\[0, n\]"):
        pass_at_k(4, 5, 1)
    with pytest.raises(RlttError, match="k must be"):
        pass_at_k(4, 1, 0)
