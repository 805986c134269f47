"""The review's asynchronous-RL diagnoses: a learner that waits for rollouts more than half of each
step, and partial rollouts that drop most rows — each with an action naming the recipe key to
change — and silence on a healthy asynchronous run."""

import numpy as np

from rltt.telemetry import diagnoses as dx
from rltt.telemetry import schema as m
from rltt.telemetry.series import RunData

from ...telemetry.telemetry_synth import healthy_records, mutate

ROWS = 16  # rollout/sequences per step: 4 prompts x 4 rows


def async_records(n: int = 40, idle: float = 0.1, dropped: float = 0.0, seed: int = 0) -> list[dict]:
    """A healthy run with partial rollouts: the learner idle ``idle`` of each step, ``dropped`` rows
    dropped per ``ROWS`` trained (a little noise on both)."""
    rng = np.random.default_rng(seed)
    records = healthy_records(n=n, seed=seed)
    return mutate(records, 0, rollout__sequences=ROWS,
                  orchestration__learner_idle_frac=lambda i, r: float(np.clip(idle + rng.normal(0, 0.03), 0, 1)),
                  orchestration__rollout_idle_frac=lambda i, r: float(np.clip(0.05 + rng.normal(0, 0.01), 0, 1)),
                  orchestration__dropped_rows=lambda i, r: int(round(dropped * ROWS * (1 + rng.normal(0, 0.1)))),
                  orchestration__partial_rows=3, orchestration__staleness=2, orchestration__staleness_mean=1.2)


def ids(records) -> list[str]:
    return [d.id for d in dx.diagnose(RunData.from_records(records))]


def test_a_healthy_asynchronous_run_is_quiet():
    for seed in range(3):
        run = RunData.from_records(async_records(idle=0.2, dropped=0.1, seed=seed))
        assert dx.diagnose(run) == [] and dx.unchecked(run) == []


def test_a_waiting_learner_is_reported_with_the_keys_to_change():
    records = mutate(async_records(), 20, orchestration__learner_idle_frac=0.7)
    found = dx.diagnose(RunData.from_records(records))
    assert [d.id for d in found] == ["learner_waiting"]
    d = found[0]
    assert d.evidence[0].metric == m.ORCH_LEARNER_IDLE_FRAC and d.evidence[0].observed == 0.7
    assert d.evidence[0].threshold == dx.LEARNER_IDLE_MAX
    for key in ("orchestration.max_staleness", "orchestration.partial_rollouts", "orchestration.ray.rollout_workers"):
        assert key in d.action
    assert "learner_waiting" not in ids(mutate(async_records(), 20, orchestration__learner_idle_frac=0.45))


def test_most_rows_dropped_is_reported_with_the_keys_to_change():
    records = mutate(async_records(), 20, orchestration__dropped_rows=3 * ROWS)  # 3 dropped per row trained
    found = dx.diagnose(RunData.from_records(records))
    assert [d.id for d in found] == ["rows_dropped"]
    d = found[0]
    assert d.evidence[0].metric == m.ORCH_DROPPED_ROWS and d.evidence[0].observed == 0.75
    assert "orchestration.max_staleness" in d.action and "rollout.max_new_tokens" in d.action
    # as many dropped as trained is half, not most; an early burst that stopped is not reported
    assert "rows_dropped" not in ids(mutate(async_records(), 20, orchestration__dropped_rows=ROWS))
    assert "rows_dropped" not in ids(mutate(mutate(async_records(), 0, orchestration__dropped_rows=10 * ROWS), 15,
                                            orchestration__dropped_rows=0))


def test_a_run_without_the_async_metrics_is_quiet_and_counts_as_checked():
    run = RunData.from_records(healthy_records())
    assert dx.check_learner_waiting(run) is None and dx.check_rows_dropped(run) is None
    assert dx.unchecked(run) == []
