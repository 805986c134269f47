"""Bootstrap intervals cover the truth at about the nominal rate on simulated data, and the
two-level bootstrap counts the between-run variance a problems-only bootstrap misses."""

from math import exp, lgamma

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.errors import RlttError
from rltt.evaluation.intervals import bootstrap_mean, bootstrap_means
from rltt.evaluation.passk import pass_at_k

A, B = 0.6, 0.9  # problems' solve probabilities ~ Beta(A, B)


def population_pass_at_k(k: int) -> float:
    """1 − E[(1 − p)^k] for p ~ Beta(A, B): 1 − B(A, B + k) / B(A, B)."""
    return 1.0 - exp(lgamma(A + B) - lgamma(B) + lgamma(B + k) - lgamma(A + B + k))


def test_problem_bootstrap_covers_pass_at_k_at_the_nominal_rate():
    rng = np.random.default_rng(11)
    datasets, problems, samples = 200, 100, 4
    hits = {1: 0, 4: 0}
    for d in range(datasets):
        c = rng.binomial(samples, rng.beta(A, B, problems))
        n = np.full(problems, samples)
        ests = bootstrap_means([pass_at_k(n, c, 1), pass_at_k(n, c, 4)], reps=1000, seed=d)
        for k, e in zip((1, 4), ests):
            hits[k] += e.lo <= population_pass_at_k(k) <= e.hi
            assert e.lo <= e.mean <= e.hi and e.se > 0
    for k, h in hits.items():
        assert 0.90 <= h / datasets <= 0.98, (k, h / datasets)


def test_two_level_bootstrap_counts_the_between_run_variance():
    """Runs share the problems but each has its own offset (a training seed's effect): the
    two-level interval covers the mean at about 95 %; resampling problems alone does not."""
    rng = np.random.default_rng(5)
    datasets, runs, problems, truth = 200, 6, 100, 0.5
    two_level = problems_only = 0
    for d in range(datasets):
        scores = (rng.normal(truth, 0.2, problems)[None, :] + rng.normal(0, 0.05, runs)[:, None]
                  + rng.normal(0, 0.1, (runs, problems)))
        e = bootstrap_mean(scores, reps=500, seed=d)
        two_level += e.lo <= truth <= e.hi
        e1 = bootstrap_mean(scores.mean(axis=0), reps=500, seed=d)
        problems_only += e1.lo <= truth <= e1.hi
    assert 0.88 <= two_level / datasets <= 0.99, two_level / datasets
    assert problems_only / datasets < two_level / datasets - 0.1, (problems_only, two_level)


def test_seeded_and_reproducible():
    scores = np.random.default_rng(0).random((3, 40))
    assert bootstrap_mean(scores, seed=3) == bootstrap_mean(scores, seed=3)
    assert bootstrap_mean(scores, seed=3) != bootstrap_mean(scores, seed=4)
    assert bootstrap_mean(scores).mean == pytest.approx(scores.mean())


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 30), st.floats(0, 1))
def test_constant_scores_have_a_zero_width_interval(runs, problems, value):
    e = bootstrap_mean(np.full((runs, problems), value), reps=50)
    assert e.se == pytest.approx(0.0, abs=1e-12)
    assert e.lo == pytest.approx(value) and e.hi == pytest.approx(value) and e.mean == pytest.approx(value)


def test_bad_shapes_are_errors():
    with pytest.raises(RlttError, match="shape"):
        bootstrap_mean(np.zeros((2, 0)))
    with pytest.raises(RlttError, match="same"):
        bootstrap_means([np.zeros((2, 3)), np.zeros((2, 4))])
    with pytest.raises(RlttError, match="reps"):
        bootstrap_mean(np.zeros(3), reps=1)
