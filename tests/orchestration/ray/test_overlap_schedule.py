"""`OverlappedStep`'s deterministic pipeline without a cluster: with ``max_staleness`` K the rows of
step n are sampled with version max(0, n − 1 − K) (the weights of step max(1, n − K)'s start), so a
step's staleness is min(n − 1, K), and at most K steps of rows are held ahead."""

import pytest

from rltt.orchestration.ray import overlap
from rltt.orchestration.ray.overlap import STALENESS, STALENESS_MEAN, OverlappedStep


class _Engine:
    weights_version = 0


class _Learner:
    version = 0
    during_update = None


def _pipeline(monkeypatch, K: int, steps: int, skipped=()):
    """Drive the step's rollout / update hooks as `TrainingStep.__call__` does; returns, per step,
    (the version its rows were sampled with, its staleness, rows held ahead after its update)."""
    engine, learner = _Engine(), _Learner()
    monkeypatch.setattr(overlap.TrainingStep, "rollout", lambda self, step: (f"rows of {step}", {}))
    step = OverlappedStep.__new__(OverlappedStep)
    step.engine, step.learner = engine, learner
    step.max_staleness, step.last_step, step.ahead, step._used, step._step, step._fresh = K, steps, [], None, 0, []
    step._gen_s = 0.0
    if K:
        learner.during_update = step._sample_ahead
    out = []
    for n in range(1, steps + 1):
        step._step = n
        groups, metrics = step.rollout(n)
        assert groups == f"rows of {n}" and metrics[STALENESS_MEAN] == metrics[STALENESS]
        if learner.during_update is not None:
            learner.during_update()
        if n not in skipped:  # an update the guard skipped keeps the version: nothing to sync
            learner.version += 1
            engine.weights_version = learner.version
        out.append((step._used.version, metrics[STALENESS], len(step.ahead)))
    return out


@pytest.mark.parametrize("K", [0, 1, 2, 3])
def test_step_n_is_sampled_at_version_n_minus_1_minus_K(monkeypatch, K):
    steps = 7
    got = _pipeline(monkeypatch, K, steps)
    assert [v for v, _, _ in got] == [max(0, n - 1 - K) for n in range(1, steps + 1)]
    assert [s for _, s, _ in got] == [min(n - 1, K) for n in range(1, steps + 1)]
    assert [h for _, _, h in got] == [min(K, steps - n) for n in range(1, steps + 1)]  # never past the last step


def test_a_skipped_update_keeps_the_rule_in_steps_not_versions(monkeypatch):
    """Step 2's update skipped: the rows of step n are still those of the weights of step
    max(1, n − K)'s start, whose version is one lower from step 3 on."""
    got = _pipeline(monkeypatch, 2, 6, skipped={2})
    start = [0, 1, 1, 2, 3, 4]  # the learner's version at the start of steps 1-6
    assert [v for v, _, _ in got] == [start[max(1, n - 2) - 1] for n in range(1, 7)]

