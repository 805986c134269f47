import math
from pathlib import Path

import numpy as np
import pytest
from tests.telemetry.telemetry_synth import healthy_records, lm_records, mutate, quickstart_records, write_run

from rltt.telemetry import diagnoses as dx
from rltt.telemetry import schema
from rltt.telemetry.series import RunData


def priced_records(seed=0, n=60):
    """A healthy run under a compute price: reward/compute logged, the exits still spread."""
    return mutate(healthy_records(n=n, seed=seed), 0, reward__compute=lambda i, r: 0.1 * r["compute/mean_exit"] / 4)


def collapse_under_price(records, start=20, loop=1):
    """From ``start`` on every token exits at ``loop``: zero exit-step entropy, mean exit = loop."""
    def p(t):
        return lambda i, r: 0.97 if t == loop else 0.01

    return mutate(records, start, compute__exit_entropy=0.0, compute__mean_exit=float(loop),
                  compute__passes_per_token=float(loop), reward__compute=0.1 * loop / 4,
                  exit__p_1=p(1), exit__p_2=p(2), exit__p_3=p(3), exit__p_4=p(4))


def ids(records):
    return [d.id for d in dx.diagnose(RunData.from_records(records))]


def only(records, diag_id):
    found = dx.diagnose(RunData.from_records(records))
    assert [d.id for d in found] == [diag_id]
    return found[0]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_healthy_run_triggers_nothing_and_every_check_applies(seed):
    run = RunData.from_records(healthy_records(seed=seed))
    assert dx.diagnose(run) == []
    assert dx.unchecked(run) == []
    priced = RunData.from_records(priced_records(seed=seed))
    assert dx.diagnose(priced) == []
    assert dx.unchecked(priced) == []


def test_policy_not_moving_with_tiny_lr():
    records = mutate(healthy_records(), 0, lr=1e-6,
                     kl__ref=lambda i, r: 2e-4 + 1e-5 * math.sin(i))
    d = only(records, "policy_not_moving")
    assert d.severity is dx.Severity.WARNING
    metrics = [e.metric for e in d.evidence]
    assert metrics == ["kl/ref", "lr"]
    kl = d.evidence[0]
    assert kl.threshold == dx.KL_STUCK_MAX and kl.observed <= dx.KL_STUCK_MAX
    assert kl.steps == (31, 60)  # the late window
    assert "raise the learning rate" in d.action and "1e-5" in d.action


def test_policy_not_moving_needs_many_steps_and_small_kl():
    short = mutate(healthy_records(n=dx.KL_STUCK_MIN_STEPS - 1), 0, kl__ref=1e-4)
    assert ids(short) == []
    growing = mutate(healthy_records(), 0, kl__ref=lambda i, r: 1e-4 * (i + 1))
    assert ids(growing) == []


def test_policy_not_moving_small_gradient_points_at_advantages():
    records = mutate(healthy_records(), 0, kl__ref=1e-4, grad_norm__total=1e-3)
    d = only(records, "policy_not_moving")
    assert [e.metric for e in d.evidence] == ["kl/ref", "grad_norm/total"]
    assert "advantages" in d.action


@pytest.mark.parametrize("frac, severity", [(0.7, "warning"), (0.95, "critical")])
def test_uniform_groups(frac, severity):
    records = mutate(healthy_records(), 20, groups__uniform_frac=frac, solve_rate=0.05)
    d = only(records, "uniform_groups")
    assert d.severity.value == severity
    assert d.evidence[0].metric == "groups/uniform_frac"
    assert "rltt curate" in d.action
    assert "too hard" in d.detail


def test_uniform_groups_early_only_is_not_reported():
    records = mutate(healthy_records(), 0, groups__uniform_frac=lambda i, r: 0.9 if i < 20 else 0.2)
    assert ids(records) == []


def test_exit_gate_collapse():
    def p(t):
        return lambda i, r: {1: 0.97, 2: 0.01, 3: 0.01, 4: 0.01}[t]

    records = mutate(healthy_records(), 25, exit__p_1=p(1), exit__p_2=p(2), exit__p_3=p(3),
                     exit__p_4=p(4), exit__mean_step=1.06, exit__collapse=0.95)
    d = only(records, "exit_gate_collapse")
    assert d.severity is dx.Severity.CRITICAL
    assert d.evidence[0].metric == "exit/p_1"
    assert d.evidence[0].observed == pytest.approx(0.97)
    assert "since step 26" in d.detail
    assert "warmup" in d.action and "0.10" in d.action


def test_exit_gate_collapse_from_indicator_only_and_not_for_a_single_loop():
    records = healthy_records()
    for r in records:
        for t in range(1, 5):
            del r[f"exit/p_{t}"]
        r["exit/collapse"] = 0.99
    assert ids(records) == ["exit_gate_collapse"]
    single = healthy_records(T=1)
    assert all(r["exit/p_1"] == 1.0 for r in single)
    assert ids(single) == []


def test_gradient_vanishing_across_layers():
    records = mutate(healthy_records(), 0, grad_norm__layer__0=0.005, grad_norm__layer__1=0.02)
    d = only(records, "grad_vanishing_layers")
    ev = d.evidence[0]
    assert ev.metric == "grad_norm/layer/0 / grad_norm/layer/3"
    assert ev.observed < dx.GRAD_LAYER_RATIO_MIN
    assert "pre-norm" in d.action


def test_grad_norm_and_ratio_spikes_fire_in_rl():
    records = healthy_records()
    records[40]["grad_norm/total"] = 25.0
    records[50]["policy/ratio_max"] = 40.0
    d = only(records, "spikes")
    by_metric = {e.metric: e for e in d.evidence}
    assert set(by_metric) == {"grad_norm/total", "policy/ratio_max"}
    assert by_metric["grad_norm/total"].points == (41,)
    assert by_metric["policy/ratio_max"].points == (51,)
    assert by_metric["grad_norm/total"].observed > dx.SPIKE_Z


@pytest.mark.parametrize("seed", range(6))
def test_quickstart_run_is_healthy_although_its_policy_loss_jumps(seed):
    """The signed policy loss (noise around 0, occasional 10-20x jumps) is not a spike signal."""
    records = quickstart_records(seed=seed)
    run = RunData.from_records(records)
    assert dx.diagnose(run) == []
    # the loss does jump by a huge robust z: the former loss test cried wolf here
    _, loss = run.series("loss/total")
    assert len(dx.robust_spikes(loss)[0]) > 0
    assert dx.robust_spikes(loss)[1].max() > 2 * dx.SPIKE_Z


def test_rl_loss_spike_alone_is_not_reported():
    records = healthy_records()
    records[50]["loss/total"] = records[50]["loss/policy"] = 3.0
    assert "spikes" not in ids(records)


def test_pretrain_lm_loss_spike_fires_and_a_healthy_pretrain_is_quiet():
    assert dx.diagnose(RunData.from_records(lm_records())) == []
    records = lm_records()
    records[90]["lm/loss"] *= 1.6
    records[90]["loss/total"] *= 1.6
    d = only(records, "spikes")
    assert [(e.metric, e.points) for e in d.evidence] == [("lm/loss", (91,))]


def test_a_grad_norm_spike_fires_in_the_quickstart_run():
    records = quickstart_records(seed=3)
    records[120]["grad_norm/total"] = records[119]["grad_norm/total"] * 20
    d = only(records, "spikes")
    assert [(e.metric, e.points) for e in d.evidence] == [("grad_norm/total", (120,))]


def test_spikes_are_scale_aware():
    rng = np.random.default_rng(0)
    tight = 1.0 + rng.normal(0, 1e-3, 40)
    tight[30] = 1.2  # robust z ≈ 10 (the scale floor is 2 % of the level), but only +20 %
    assert len(dx.robust_spikes(tight)[0]) == 1
    assert len(dx.robust_spikes(tight, min_jump=2.0)[0]) == 0
    tight[30] = 2.5
    assert dx.robust_spikes(tight, min_jump=2.0)[0].tolist() == [30]
    signed = rng.normal(0, 1e-2, 40)
    signed[30] = 5.0  # a history that crosses zero has no level to jump from
    assert len(dx.robust_spikes(signed, min_jump=2.0)[0]) == 0


def test_spikes_ignore_a_smooth_trend_and_noise():
    rng = np.random.default_rng(5)
    records = mutate(healthy_records(n=200), 0,
                     grad_norm__total=lambda i, r: 0.5 + 0.01 * i + rng.normal(0, 0.05),
                     loss__total=lambda i, r: rng.normal(0, 0.02))
    assert ids(records) == []


def test_robust_spikes_needs_history():
    values = np.array([1.0, 100.0, 1.0, 1.0])
    idx, _ = dx.robust_spikes(values)
    assert len(idx) == 0


def test_non_finite_loss_is_critical():
    records = healthy_records()
    records[30]["loss/total"] = float("nan")
    records[31]["grad_norm/total"] = float("inf")
    found = dx.diagnose(RunData.from_records(records))
    assert found[0].id == "non_finite" and found[0].severity is dx.Severity.CRITICAL
    points = {e.metric: e.points for e in found[0].evidence}
    assert points == {"loss/total": (31,), "grad_norm/total": (32,)}


@pytest.mark.parametrize("key, value", [("mismatch/max_abs", 0.05), ("mismatch/k3", 5e-3)])
def test_logprob_mismatch(key, value):
    records = mutate(healthy_records(), 40, **{key.replace("/", "__"): value})
    d = only(records, "logprob_mismatch")
    assert d.evidence[0].metric == key
    assert d.evidence[0].points == tuple(range(41, 61))
    assert d.severity is dx.Severity.WARNING  # a third of the steps
    records = mutate(healthy_records(), 10, **{key.replace("/", "__"): value})
    assert only(records, "logprob_mismatch").severity is dx.Severity.CRITICAL


def test_single_mismatch_blip_in_a_long_run_is_tolerated():
    records = healthy_records(n=60)
    records[10]["mismatch/max_abs"] = 0.05  # 1 of 60 steps < 10 %
    assert ids(records) == []


def test_reward_errors():
    records = healthy_records()
    records[7]["reward/errors"] = 3
    records[9]["reward/errors"] = 1
    d = only(records, "reward_errors")
    assert d.evidence[0].observed == 4 and d.evidence[0].points == (8, 10)


def test_truncation():
    records = mutate(healthy_records(), 10, length__trunc_frac=0.45)
    d = only(records, "truncation")
    assert d.evidence[0].observed == pytest.approx(0.45)
    assert "max_new_tokens" in d.action


def test_entropy_collapse():
    records = mutate(healthy_records(), 20, entropy__loop_4=0.01)
    d = only(records, "entropy_collapse")
    assert d.evidence[0].metric == "entropy/loop_4"


def test_partial_and_sparse_runs_are_quiet():
    assert dx.diagnose(RunData.from_records(healthy_records(n=3))) == []
    sparse = RunData.from_records([{"step": 1, "lm/loss": 5.0}, {"step": 2, "lm/loss": 4.9}])
    assert dx.diagnose(sparse) == []
    assert {c.id for c in dx.unchecked(sparse)} >= {"policy_not_moving", "uniform_groups"}
    assert "spikes" not in {c.id for c in dx.unchecked(sparse)}


def test_lm_stage_collapse_and_spikes():
    rng = np.random.default_rng(0)
    records = []
    for i in range(80):
        p1 = 0.3 if i < 30 else 0.95
        rest = (1 - p1) / 3
        records.append({"step": i + 1, "lm/loss": 6.0 - 0.02 * i + rng.normal(0, 0.02),
                        "exit/p_1": p1, "exit/p_2": rest, "exit/p_3": rest, "exit/p_4": rest})
    records[60]["lm/loss"] = 20.0
    assert sorted(ids(records)) == ["exit_gate_collapse", "spikes"]


def test_severity_order_and_describe():
    records = healthy_records()
    records[7]["reward/errors"] = 1
    records[30]["loss/total"] = float("nan")
    found = dx.diagnose(RunData.from_records(records))
    assert [d.id for d in found] == ["non_finite", "reward_errors"]
    text = found[1].describe()
    assert "[warning]" in text and "reward/errors" in text and "action:" in text


def test_policy_drift_with_a_falling_reward_is_critical():
    records = mutate(healthy_records(), 20, kl__ref=lambda i, r: 0.1 * i, reward__mean=0.05)
    d = only(records, "policy_drift")
    assert d.severity is dx.Severity.CRITICAL
    assert [e.metric for e in d.evidence] == ["kl/ref", "reward/mean"]
    assert "lower the learning rate" in d.action


def test_moderate_kl_is_not_drift():
    records = mutate(healthy_records(), 0, kl__ref=0.2)
    assert "policy_drift" not in ids(records)


def test_a_real_logged_quickstart_run_is_healthy():
    """`rltt train recipes/quickstart.yaml train.steps=80 train.eval_every=0` (CPU, fp32), logged
    with strict keys: its policy loss jumps by a robust z of ~17, which the former loss-spike
    test reported as a warning on this healthy run."""
    run = RunData.load(Path(__file__).parent / "data" / "quickstart_80_steps.jsonl")
    assert len(run) == 80
    assert dx.diagnose(run) == []
    _, loss = run.series("loss/total")
    assert dx.robust_spikes(loss)[1].max() > 2 * dx.SPIKE_Z
    # every check could look at it but the rounding one: the run was logged before sync/changed_frac
    assert [c.id for c in dx.unchecked(run)] == ["rounding_lost"]
    assert {k for r in run.records for k in r if schema.lookup(k) is None} == set()


def test_exit_collapse_under_a_compute_price_fires_with_evidence_and_action():
    d = only(collapse_under_price(priced_records()), "compute_exit_collapse")
    assert d.severity is dx.Severity.WARNING  # the task reward kept rising
    e = d.evidence[0]
    assert (e.metric, e.statistic, e.comparison) == ("compute/exit_entropy", "median", "<")
    assert e.observed == 0.0 and e.threshold == dx.COMPUTE_EXIT_ENTROPY_MIN and e.steps == (31, 60)
    assert "onto loop 1" in d.detail and "algorithm.compute_cost" in d.action
    # the gate's own collapse check defers to it (one diagnosis, the one with the compute action)
    assert "exit_gate_collapse" not in ids(collapse_under_price(priced_records()))


def test_exit_collapse_under_a_price_onto_the_last_loop_and_with_a_falling_reward_is_critical():
    records = mutate(collapse_under_price(priced_records(), loop=4), 20, reward__mean=0.1)
    d = only(records, "compute_exit_collapse")
    assert d.severity is dx.Severity.CRITICAL and "onto loop 4" in d.detail
    assert [e.metric for e in d.evidence] == ["compute/exit_entropy", "reward/mean"]


def test_exit_collapse_under_a_price_does_not_fire_without_a_price_or_with_spread_exits():
    # the same collapse without a price: the compute check is silent, the gate-collapse check speaks
    no_price = [{k: v for k, v in r.items() if k != "reward/compute"} for r in collapse_under_price(priced_records())]
    assert ids(no_price) == ["exit_gate_collapse"]
    # a price of zero is no price
    assert "compute_exit_collapse" not in ids(mutate(collapse_under_price(priced_records()), 0, reward__compute=0.0))
    # the exits narrowed but did not collapse (entropy 0.3 nats)
    assert ids(mutate(priced_records(), 20, compute__exit_entropy=0.3)) == []
    # collapsed only early, spread again late: not reported
    early = mutate(priced_records(), 0, compute__exit_entropy=lambda i, r: 0.0 if i < 20 else r["compute/exit_entropy"])
    assert ids(early) == []
    # too few points
    assert ids(collapse_under_price(priced_records(n=4), start=0)) == []


def test_exit_collapse_under_a_price_from_the_gate_when_the_entropy_was_not_logged():
    records = [{k: v for k, v in r.items() if k != "compute/exit_entropy"}
               for r in collapse_under_price(priced_records())]
    d = only(records, "compute_exit_collapse")
    assert d.evidence[0].metric == "exit/p_1" and d.evidence[0].observed == pytest.approx(0.97)


def test_gate_collapse_under_a_price_with_still_spread_recorded_exits_names_the_price():
    records = mutate(priced_records(), 25, exit__p_1=0.93, exit__p_2=0.03, exit__p_3=0.02, exit__p_4=0.02)
    d = only(records, "exit_gate_collapse")
    assert d.action.startswith("lower algorithm.compute_cost")


def test_updates_lost_to_rounding_fire_when_the_engines_weights_stay_put(tmp_path):
    """A bf16 run at lr 1e-7: the optimizer steps (grad norm ~0.6), yet ~1 % of the trained elements change
    per update in the engines' dtype; the action names a higher lr and (not yet fp32) an fp32 learner."""
    records = mutate(healthy_records(), 0, lr=1e-7, sync__changed_frac=lambda i, r: 0.01 + 0.002 * math.sin(i))
    d = only(records, "rounding_lost")
    assert d.severity is dx.Severity.WARNING and "rounding" in d.title
    assert [e.metric for e in d.evidence] == ["sync/changed_frac", "grad_norm/total"]
    changed = d.evidence[0]
    assert changed.threshold == dx.CHANGED_FRAC_MIN and changed.observed < 0.02 and changed.steps == (31, 60)
    assert "learner.lr, now 1e-7" in d.action and "learner.dtype: fp32" in d.action
    write_run(tmp_path / "fp32", records)
    (tmp_path / "fp32" / "recipe.resolved.yaml").write_text("learner:\n  dtype: fp32\n")
    fp32 = [x for x in dx.diagnose(RunData.load(tmp_path / "fp32")) if x.id == "rounding_lost"]
    assert fp32 and "learner.dtype" not in fp32[0].action  # already fp32: only the lr is offered
    assert "learner.rounding: stochastic" in d.action and "learner.rounding" not in fp32[0].action
    for name, learner in (("stochastic", "dtype: bf16\n  rounding: stochastic"),
                          ("deepspeed", "dtype: bf16\n  backend: deepspeed")):
        write_run(tmp_path / name, records)
        (tmp_path / name / "recipe.resolved.yaml").write_text(f"learner:\n  {learner}\n")
        found = [x for x in dx.diagnose(RunData.load(tmp_path / name)) if x.id == "rounding_lost"]
        assert found and "learner.rounding" not in found[0].action, name  # already on, or not built there


def test_updates_lost_to_rounding_stay_quiet_when_healthy_early_or_without_a_gradient():
    assert "rounding_lost" not in ids(healthy_records())  # ~70 % of the elements change per update
    early = mutate(healthy_records(), 0, sync__changed_frac=lambda i, r: 0.01 if i < 20 else 0.6)
    assert "rounding_lost" not in ids(early)  # resolved by the late window
    still = mutate(healthy_records(), 0, sync__changed_frac=0.0, grad_norm__total=0.0)
    assert "rounding_lost" not in ids(still)  # no gradient: nothing was lost
    short = mutate(healthy_records(n=dx.MIN_POINTS - 1), 0, sync__changed_frac=0.0)
    assert "rounding_lost" not in ids(short)
