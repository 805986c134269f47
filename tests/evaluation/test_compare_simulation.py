"""Every figure of a paired comparison answers one question: over many simulated comparisons the
reported standard error matches the true SD of the difference (±20 %) and the interval excludes 0
exactly when p < 0.05 — where runs differ per problem (training seeds that solve different
problems), where they barely differ (evaluation seeds of one checkpoint: sampling noise only) and
with one run a side (the problems test, problems drawn anew each time)."""

import numpy as np
import pytest

from rltt.evaluation.compare import paired_difference

TRIALS, SAMPLES = 240, 4
# world -> (runs a side, problems, run × problem logit SD, true logit shift of A, problems fixed)
WORLDS = {
    "runs differ per problem": (5, 150, 0.8, 0.22, True),
    "runs barely differ": (5, 150, 0.02, 0.10, True),
    "one run a side": (1, 150, 0.0, 0.25, False),
}


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def side(rng, logits, runs, spread):
    """(runs, P) pass@1 estimates: each run's own per-problem logits, SAMPLES samples a problem."""
    p = sigmoid(logits[None, :] + rng.normal(0.0, spread, (runs, logits.size))) if spread else \
        np.broadcast_to(sigmoid(logits), (runs, logits.size))
    return rng.binomial(SAMPLES, p) / SAMPLES


def simulate(world):
    runs, problems, spread, shift, fixed = WORLDS[world]
    rng = np.random.default_rng(sorted(WORLDS).index(world))
    logits = rng.normal(-0.3, 1.5, problems)
    out = []
    for trial in range(TRIALS):
        if not fixed:  # the problems test's question: problems of the task drawn anew
            logits = rng.normal(-0.3, 1.5, problems)
        a, b = side(rng, logits + shift, runs, spread), side(rng, logits, runs, spread)
        out.append(paired_difference(a, b, seed=trial, permutations=999))
    return out


@pytest.mark.parametrize("world", list(WORLDS))
def test_standard_error_interval_and_p_value_answer_one_question(world):
    results = simulate(world)
    estimates = np.array([r.estimate.mean for r in results])
    se = np.array([r.estimate.se for r in results])
    truth = estimates.std(ddof=1)  # the difference's SD over repeated comparisons
    assert 0.8 <= np.sqrt(np.mean(se ** 2)) / truth <= 1.2, (np.sqrt(np.mean(se ** 2)), truth)
    significant = np.array([r.p_value < 0.05 for r in results])
    excludes = np.array([r.estimate.lo > 0 or r.estimate.hi < 0 for r in results])
    assert 0.2 <= significant.mean() <= 0.8, significant.mean()  # near the boundary, both ways
    assert np.mean(significant == excludes) >= 0.95, np.mean(significant == excludes)
