"""The env/* metrics of a multi-turn step (hand-computed) and the two episode diagnoses."""

from types import SimpleNamespace

import pytest
import torch

from rltt.orchestration.step import rollout_metrics
from rltt.rollout.rollout_batch import RolloutStats
from rltt.runtime.distributed import Ranks
from rltt.telemetry import diagnoses as dx
from rltt.telemetry import schema as m
from rltt.telemetry.series import RunData
from tests.telemetry.telemetry_synth import healthy_records, mutate, write_run


def _scored(env):
    rollout = SimpleNamespace(stats=RolloutStats(row_passes=torch.tensor([9, 4, 6, 2]), tokens=8),
                              completion_lengths=torch.tensor([3, 2, 4, 1]), finish_reasons=["stop"] * 3 + ["length"],
                              exit_steps=torch.tensor([[1, 2, 0], [2, 2, 0], [1, 1, 3], [4, 0, 0]]), num_loops=4,
                              action_mask=torch.tensor([[True, True, False], [True, True, False], [True, True, True],
                                                        [True, False, False]]))
    scored = SimpleNamespace(rollout=rollout, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), errors=[], env=env,
                             per_fn={"gsm8k.strict": torch.tensor([1.0, 0.0, 1.0, 0.0])})
    return scored, SimpleNamespace(uniform=torch.tensor([False, False]), num_groups=2, compute=None)


def test_env_metrics_of_known_episodes():
    env = {"turns": torch.tensor([3, 1, 2, 4]), "tool_calls": torch.tensor([2, 0, 1, 4]),
           "tool_errors": torch.tensor([1, 0, 0, 2]), "truncated": torch.tensor([False, False, False, True]),
           "errors": torch.tensor([False, True, False, False])}
    metrics = rollout_metrics(*_scored(env), Ranks(), "gsm8k.strict")
    assert metrics[m.ENV_TURNS_MEAN] == pytest.approx(10 / 4)
    assert metrics[m.ENV_TOOL_CALLS_MEAN] == pytest.approx(7 / 4)
    assert metrics[m.ENV_TOOL_USE_FRAC] == pytest.approx(3 / 4)  # episodes with at least one call
    assert metrics[m.ENV_TOOL_ERRORS] == 3 and metrics[m.ENV_ERRORS] == 1
    assert metrics[m.ENV_TRUNCATED_FRAC] == pytest.approx(0.25) and metrics[m.ENV_REWARD_MEAN] == pytest.approx(0.5)
    assert metrics[m.COMPUTE_MEAN_EXIT] == pytest.approx(16 / 8)  # model tokens only
    assert not m.unknown_keys(metrics)
    single = rollout_metrics(*_scored(None), Ranks(), "gsm8k.strict")
    assert not any(key.startswith("env/") for key in single)


def _episodes(**changes):
    records = healthy_records()
    for r in records:
        r.update({m.ENV_TURNS_MEAN: 2.5, m.ENV_TOOL_CALLS_MEAN: 1.2, m.ENV_TOOL_ERRORS: 0,
                  m.ENV_TRUNCATED_FRAC: 0.05, m.ENV_REWARD_MEAN: r[m.REWARD_MEAN], m.ENV_ERRORS: 0})
    return mutate(records, 30, **changes)


def test_healthy_episodes_are_quiet_and_single_turn_runs_count_as_checked():
    assert dx.diagnose(RunData.from_records(_episodes())) == []
    single = RunData.from_records(healthy_records())
    assert {"tools_unused", "turn_limit"}.isdisjoint(c.id for c in dx.unchecked(single))


def test_a_policy_that_stops_calling_the_tool_is_diagnosed():
    found = dx.diagnose(RunData.from_records(_episodes(env__tool_calls_mean=0.0, env__turns_mean=1.0)))
    assert [d.id for d in found] == ["tools_unused"]
    assert found[0].evidence[0].metric == m.ENV_TOOL_CALLS_MEAN
    assert dx.diagnose(RunData.from_records(_episodes(env__tool_calls_mean=0.05))) == []  # some calls: quiet


def test_episodes_at_the_turn_limit_are_diagnosed_with_the_recipe_limit(tmp_path):
    records = _episodes(env__truncated_frac=0.95, env__turns_mean=3.9)
    (d,) = dx.diagnose(RunData.from_records(records))
    assert d.id == "turn_limit" and d.title == "Episodes are cut by their limits"  # no recipe: the limit unknown
    run_dir = write_run(tmp_path / "run", records)
    (run_dir / "recipe.resolved.yaml").write_text("env:\n  name: tools\n  max_turns: 4\n")
    (d,) = dx.diagnose(RunData.load(run_dir))
    assert d.title == "Episodes run to the turn limit"
    assert [e.metric for e in d.evidence] == [m.ENV_TRUNCATED_FRAC, m.ENV_TURNS_MEAN]
    (run_dir / "recipe.resolved.yaml").write_text("env:\n  name: tools\n  max_turns: 8\n")
    assert dx.diagnose(RunData.load(run_dir))[0].title == "Episodes are cut by their limits"
    assert dx.diagnose(RunData.from_records(_episodes(env__truncated_frac=0.3))) == []
