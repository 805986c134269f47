"""The spike diagnosis judges a gradient-norm outlier by its scale, the run's gradient clipping and
what followed it; the mismatch-growing diagnosis watches the rollout correction's masked share."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from tests.telemetry.telemetry_synth import healthy_records, mutate, write_run

from rltt.telemetry import diagnoses as dx
from rltt.telemetry.run_review import review
from rltt.telemetry.series import RunData

QUICKSTART = Path(__file__).parent / "data" / "quickstart_80_steps.jsonl"


def quickstart():
    return [json.loads(line) for line in QUICKSTART.read_text().splitlines()]


def run_dir(tmp_path, records, grad_clip=None, name="run"):
    """A run directory as `rltt train` leaves it: metrics plus the resolved recipe."""
    path = write_run(tmp_path / name, records)
    if grad_clip is not None:
        (path / "recipe.resolved.yaml").write_text(yaml.safe_dump({"learner": {"grad_clip": grad_clip, "lr": 1e-4}}))
    return path


def ids(run):
    return [d.id for d in dx.diagnose(run)]


def level(records, i, key="grad_norm/total"):
    return float(np.median([r[key] for r in records[max(0, i - dx.SPIKE_WINDOW):i]]))


def diverge(records, i, factor=10.0):
    """Step i diverges: grad norm and |loss| ``factor``× their neighbours, and the reward collapses after."""
    records[i]["grad_norm/total"] = factor * level(records, i)
    records[i]["loss/total"] = records[i]["loss/policy"] = factor * level(records, i, "loss/total") + 0.1
    for r in records[i + 1:i + 6]:
        r["reward/mean"] = r["solve_rate"] = 0.02
    return records


def test_the_real_quickstart_run_reviews_healthy(tmp_path):
    run = RunData.load(run_dir(tmp_path, quickstart(), grad_clip=1.0))
    assert dx.grad_clip(run) == 1.0
    report = review(run.path, plots=False)
    assert report.diagnoses == [] and report.healthy


@pytest.mark.parametrize("grad_clip", [None, 1.0])
def test_a_clipped_three_fold_grad_norm_step_is_not_a_warning(tmp_path, grad_clip):
    """The false alarm: one step at 1.65 against a median of ~0.55 under grad_clip 1.0 (and, since no
    reward drop followed, not without the clip known either), at any step of the healthy run."""
    old_alarms = 0
    for i in range(dx.SPIKE_MIN_HISTORY + 1, 80, 5):
        records = quickstart()
        records[i]["grad_norm/total"] = 1.65
        grad = np.array([r["grad_norm/total"] for r in records])
        old_alarms += len(dx.robust_spikes(grad, min_jump=dx.SPIKE_MIN_JUMP["grad_norm/total"])[0])
        run = RunData.load(run_dir(tmp_path, records, grad_clip, name=f"run{i}"))
        assert ids(run) == [], i
    assert old_alarms >= 5  # the former test called most of these a spike


@pytest.mark.parametrize("grad_clip", [None, 1.0])
def test_a_real_diverging_step_fires(tmp_path, grad_clip):
    records = diverge(quickstart(), 40)
    run = RunData.load(run_dir(tmp_path, records, grad_clip))
    found = dx.diagnose(run)
    assert [d.id for d in found] == ["spikes"] and found[0].severity is dx.Severity.WARNING
    by_metric = {e.metric: e for e in found[0].evidence}
    assert by_metric["grad_norm/total"].points == (records[40]["step"],)
    reward = by_metric["reward/mean"]  # the consequence is part of the evidence
    assert reward.steps == (records[41]["step"], records[43]["step"]) and reward.observed < reward.threshold
    assert ("clipped at 1" in found[0].detail) == (grad_clip is not None)


def test_a_large_spike_under_a_bounding_clip_without_consequence_is_quiet(tmp_path):
    records = quickstart()
    records[40]["grad_norm/total"] = 12 * level(records, 40)
    assert ids(RunData.load(run_dir(tmp_path, records, grad_clip=1.0))) == []
    # the same spike with no clip known, or a clip too loose to bound it, is a warning on its scale
    assert ids(RunData.load(run_dir(tmp_path, records, name="unknown"))) == ["spikes"]
    assert ids(RunData.load(run_dir(tmp_path, records, grad_clip=50.0, name="loose"))) == ["spikes"]


def test_a_moderate_spike_followed_by_a_reward_drop_fires_only_when_unclipped(tmp_path):
    records = diverge(quickstart(), 40, factor=4.0)
    assert ids(RunData.load(run_dir(tmp_path, records))) == ["spikes"]
    assert ids(RunData.load(run_dir(tmp_path, records, grad_clip=1.0, name="clipped"))) == []


def test_moved_after_needs_a_drop_beyond_the_noise():
    rng = np.random.default_rng(0)
    steps = np.arange(1, 41)
    reward = 0.4 + rng.normal(0, 0.1, 40)
    assert dx.moved_after(steps, reward, 20, "down", 0.05) is None
    reward[20:23] = 0.0
    mean, threshold, span = dx.moved_after(steps, reward, 20, "down", 0.05)
    assert mean == 0.0 and threshold < 0.4 and span == (21, 23)
    assert dx.moved_after(steps, reward, 39, "down", 0.05) is None  # nothing after it yet


def test_grad_clip_is_read_only_from_a_run_directory(tmp_path):
    assert dx.grad_clip(RunData.from_records(healthy_records())) is None
    path = run_dir(tmp_path, healthy_records(), grad_clip=0.0)
    assert dx.grad_clip(RunData.load(path)) is None  # clipping off
    (path / "recipe.resolved.yaml").write_text(yaml.safe_dump({"optim": {"grad_clip": 0.5}}))  # an LM stage
    assert dx.grad_clip(RunData.load(path)) == 0.5


# --------------------------------------------------------------------------- mismatch growing


def with_correction(records, masked):
    for i, r in enumerate(records):
        r.update({"correction/masked_frac": masked(i), "correction/weight_mean": 1.0, "correction/weight_max": 1.8})
    return records


def test_a_growing_masked_share_is_a_warning_and_a_large_one_critical():
    steady = with_correction(healthy_records(), lambda i: 0.004)
    assert ids(RunData.from_records(steady)) == []
    growing = with_correction(healthy_records(), lambda i: 0.004 + 0.002 * i)  # 0.4 % → 12 %
    found = dx.diagnose(RunData.from_records(growing))
    assert [d.id for d in found] == ["mismatch_growing"] and found[0].severity is dx.Severity.WARNING
    assert found[0].evidence[0].metric == "correction/masked_frac"
    assert "correction_lo" in found[0].action and "teach" in found[0].action
    large = with_correction(healthy_records(), lambda i: 0.3)
    found = dx.diagnose(RunData.from_records(large))
    assert [d.id for d in found] == ["mismatch_growing"] and found[0].severity is dx.Severity.CRITICAL


def test_a_mismatch_trend_under_the_limit_is_reported_once_and_above_it_by_the_mismatch_check():
    records = mutate(healthy_records(), 0, mismatch__k3=lambda i, r: 1e-6 * 1.15 ** i)  # 1e-6 → 4e-3
    assert "logprob_mismatch" in ids(RunData.from_records(records))
    assert "mismatch_growing" not in ids(RunData.from_records(records))
    records = mutate(healthy_records(), 0, mismatch__k3=lambda i, r: 2e-5 * 1.06 ** i)  # 2e-5 → 6.5e-4
    found = dx.diagnose(RunData.from_records(records))
    assert [d.id for d in found] == ["mismatch_growing"]
    assert found[0].evidence[0].metric == "mismatch/k3" and "weight" in found[0].action


def test_the_new_diagnoses_leave_the_healthy_synthetic_runs_alone():
    for seed in range(3):
        run = RunData.from_records(copy.deepcopy(healthy_records(seed=seed)))
        assert dx.diagnose(run) == [] and dx.unchecked(run) == []
