"""`rollout_metrics`: a quantity the engine did not measure is absent, never a placeholder 0."""

from types import SimpleNamespace

import pytest
import torch

from rltt.runtime.distributed import Ranks
from rltt.orchestration.step import rollout_metrics
from rltt.rollout.rollout_batch import RolloutStats
from rltt.telemetry import schema as m


def _scored(stats: RolloutStats):
    rollout = SimpleNamespace(stats=stats, completion_lengths=torch.tensor([3, 2]), finish_reasons=["stop", "length"],
                              exit_steps=torch.tensor([[1, 2, 3], [2, 2, 0]]),
                              action_mask=torch.tensor([[True, True, True], [True, True, False]]))
    scored = SimpleNamespace(rollout=rollout, rewards=torch.tensor([1.0, 0.0]), errors=[],
                             per_fn={"gsm8k.strict": torch.tensor([1.0, 0.0])})
    return scored, SimpleNamespace(uniform=torch.tensor([False]), num_groups=1)


@pytest.mark.parametrize("counted", [True, False])
def test_passes_per_token_only_when_the_engine_counts_them(counted):
    stats = RolloutStats(row_passes=torch.tensor([9, 4]) if counted else None, tokens=5 if counted else 0)
    metrics = rollout_metrics(*_scored(stats), Ranks(), "gsm8k.strict")
    if counted:
        assert metrics[m.ROLLOUT_PASSES_PER_TOKEN] == pytest.approx(13 / 5)
    else:  # vLLM does not count passes: the key is left out
        assert m.ROLLOUT_PASSES_PER_TOKEN not in metrics
    assert metrics[m.ROLLOUT_SEQUENCES] == 2 and metrics["rollout/exit_step_mean"] == pytest.approx(10 / 5)
    assert not m.unknown_keys(metrics)
