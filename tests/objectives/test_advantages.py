"""The advantage-estimator table (docs/design.md §5.5): each estimator against its formula written
out with Python's statistics, on random rewards (hypothesis)."""

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.errors import RlttError
from rltt.learner import AlgorithmConfig
from rltt.objectives import ADVANTAGE_ESTIMATORS, group_advantages

DELTA = 1e-6


def _groups(values, G):
    return [values[g * G:(g + 1) * G] for g in range(len(values) // G)]


def _sd(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def naive(estimator, rewards, G, scale):
    """The estimators' formulas, one completion at a time."""
    groups = _groups(rewards, G)
    out = []
    if estimator == "reinforce_pp":  # REINFORCE++: group-mean baseline, whitened over the batch
        x = [r - statistics.fmean(grp) for grp in groups for r in grp]
        mu, sd = statistics.fmean(x), _sd(x)
        out = [(v - mu) / (sd + DELTA) for v in x]
    else:
        for grp in groups:
            for i, r in enumerate(grp):
                if estimator == "grpo":
                    baseline = statistics.fmean(grp)
                else:  # rloo: the mean of the other completions of the group
                    baseline = statistics.fmean(grp[:i] + grp[i + 1:])
                norm = {"group": _sd(grp) + DELTA, "batch": _sd(rewards) + DELTA, "none": 1.0}[scale]
                out.append((r - baseline) / norm)
    # a group whose rewards are all equal has no signal: exactly zero
    for g, grp in enumerate(groups):
        if len(set(grp)) == 1:
            out[g * G:(g + 1) * G] = [0.0] * G
    return out


@pytest.mark.parametrize("estimator, scale", [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"),
                                              ("rloo", "group"), ("rloo", "batch"), ("rloo", "none"),
                                              ("reinforce_pp", "batch")])
@settings(max_examples=30, deadline=None)
@given(G=st.integers(2, 5), n=st.integers(1, 4), data=st.data())
def test_every_estimator_matches_its_formula(estimator, scale, G, n, data):
    values = data.draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, -0.5, 0.7038277387619019]),
                                min_size=G * n, max_size=G * n))
    out = group_advantages(torch.tensor(values, dtype=torch.float64), G, scale, estimator=estimator)
    torch.testing.assert_close(out.advantages, torch.tensor(naive(estimator, values, G, scale), dtype=torch.float64),
                               rtol=1e-9, atol=1e-9)
    for g, grp in enumerate(_groups(values, G)):
        if len(set(grp)) == 1:
            assert torch.equal(out.advantages[g * G:(g + 1) * G], torch.zeros(G, dtype=torch.float64))


def test_rloo_is_reward_minus_the_mean_of_the_others():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 1.0, 3.0])
    adv = group_advantages(rewards, 4, "none", estimator="rloo").advantages
    expected = [1.0 - 0.5 / 3, 0.0 - 1.5 / 3, 0.0 - 1.5 / 3, 0.5 - 1.0 / 3,
                2.0 - 6.0 / 3, 2.0 - 6.0 / 3, 1.0 - 7.0 / 3, 3.0 - 5.0 / 3]
    torch.testing.assert_close(adv, torch.tensor(expected))
    # = G/(G−1) · (r − group mean): Dr. GRPO's advantage rescaled
    grpo = group_advantages(rewards, 4, "none").advantages
    torch.testing.assert_close(adv, grpo * 4 / 3)
    with pytest.raises(RlttError, match="group_size >= 2"):
        group_advantages(rewards, 1, "none", estimator="rloo")


def test_grpo_is_the_default_with_todays_values():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0, 0.2, 0.2])
    for scale in ("group", "batch", "none"):
        assert torch.equal(group_advantages(rewards, 2, scale).advantages,
                           group_advantages(rewards, 2, scale, estimator="grpo").advantages)
    assert AlgorithmConfig().advantage == "grpo"


def test_reinforce_pp_whitens_over_the_batch_and_needs_the_batch_scale():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    adv = group_advantages(rewards, 2, "batch", estimator="reinforce_pp").advantages
    nonzero = adv[adv != 0]
    assert abs(float(adv.mean())) < 1e-12  # centred over the batch
    assert float(adv.std()) == pytest.approx(1.0, rel=1e-5)  # unit (sample) std, to δ
    assert torch.equal(adv[2:6], torch.zeros(4, dtype=torch.float64)) and len(nonzero) == 4  # uniform groups
    with pytest.raises(RlttError, match="advantage_scale must be 'batch'"):
        group_advantages(rewards, 2, "group", estimator="reinforce_pp")
    with pytest.raises(RlttError, match="algorithm.advantage_scale"):
        AlgorithmConfig(advantage="reinforce_pp")  # the default scale is group
    assert AlgorithmConfig(advantage="reinforce_pp", advantage_scale="batch").advantage == "reinforce_pp"


def test_estimator_table_is_the_recipe_menu():
    assert tuple(ADVANTAGE_ESTIMATORS) == ("grpo", "rloo", "reinforce_pp")
    with pytest.raises(RlttError, match="algorithm.advantage"):
        AlgorithmConfig(advantage="gae")
    with pytest.raises(RlttError, match="'gae'"):
        group_advantages(torch.zeros(4), 2, estimator="gae")
