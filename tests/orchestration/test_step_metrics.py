"""`rollout_metrics`: a quantity the engine did not measure is absent, never a placeholder 0."""

from types import SimpleNamespace

import pytest
import torch

from rltt.runtime.distributed import Ranks
from rltt.orchestration.step import rollout_metrics
from rltt.rollout.rollout_batch import RolloutStats
from rltt.telemetry import schema as m


def _scored(stats: RolloutStats, compute=None):
    rollout = SimpleNamespace(stats=stats, completion_lengths=torch.tensor([3, 2]), finish_reasons=["stop", "length"],
                              exit_steps=torch.tensor([[1, 2, 3], [2, 2, 0]]), num_loops=4,
                              action_mask=torch.tensor([[True, True, True], [True, True, False]]))
    scored = SimpleNamespace(rollout=rollout, rewards=torch.tensor([1.0, 0.0]), errors=[],
                             per_fn={"gsm8k.strict": torch.tensor([1.0, 0.0])})
    return scored, SimpleNamespace(uniform=torch.tensor([False]), num_groups=1, compute=compute)


@pytest.mark.parametrize("counted", [True, False])
def test_passes_per_token_only_when_the_engine_counts_them(counted):
    stats = RolloutStats(row_passes=torch.tensor([9, 4]) if counted else None, tokens=5 if counted else 0)
    metrics = rollout_metrics(*_scored(stats), Ranks(), "gsm8k.strict")
    if counted:
        assert metrics[m.COMPUTE_PASSES_PER_TOKEN] == pytest.approx(13 / 5)
    else:  # vLLM does not count passes: the key is left out
        assert m.COMPUTE_PASSES_PER_TOKEN not in metrics
    assert metrics[m.ROLLOUT_SEQUENCES] == 2 and metrics[m.COMPUTE_MEAN_EXIT] == pytest.approx(10 / 5)
    assert not m.unknown_keys(metrics)


def test_compute_metrics_of_a_known_rollout():
    """Exits (1, 2, 3 | 2, 2): mean 2, histogram (1, 3, 1, 0) over T = 4 loops; one completion of two
    has a positive task reward in 0.5 s; the compute penalty is reported apart from the task reward."""
    stats = RolloutStats(row_passes=torch.tensor([9, 4]), tokens=5)
    penalty = torch.tensor([0.1, 0.05], dtype=torch.float64)
    metrics = rollout_metrics(*_scored(stats, compute=penalty), Ranks(), "gsm8k.strict", seconds=0.5)
    p = torch.tensor([1, 3, 1]) / 5
    assert metrics[m.COMPUTE_EXIT_ENTROPY] == pytest.approx(float(-(p * p.log()).sum()))
    assert metrics[m.THROUGHPUT_GOODPUT] == pytest.approx(1 / 0.5)
    assert metrics[m.REWARD_COMPUTE] == pytest.approx(0.075)
    assert metrics[m.REWARD_MEAN] == pytest.approx(0.5) and metrics[m.SOLVE_RATE] == pytest.approx(0.5)
    assert not m.unknown_keys(metrics)
    plain = rollout_metrics(*_scored(stats), Ranks(), "gsm8k.strict")  # no price, no timing: neither key
    assert m.REWARD_COMPUTE not in plain and m.THROUGHPUT_GOODPUT not in plain


def test_exit_entropy_is_zero_when_every_token_exits_at_one_step():
    from rltt.orchestration.step import exit_histogram_entropy

    assert exit_histogram_entropy(torch.tensor([0, 7, 0, 0])) == 0.0
    assert exit_histogram_entropy(torch.tensor([2, 2, 2, 2])) == pytest.approx(torch.log(torch.tensor(4.0)).item())


def test_compute_metrics_over_two_ranks():
    """Two ranks with the same rows: token and completion means as one rank's, the goodput counts
    both ranks' completions over the slowest rank's time."""
    from rltt.runtime.distributed import combine

    class TwoRanks(Ranks):
        def reduce(self, values, ops):
            slower = dict(values, seconds=values["seconds"] * 2)
            return combine([values, slower], ops)

    stats = RolloutStats(row_passes=torch.tensor([9, 4]), tokens=5)
    penalty = torch.tensor([0.1, 0.05], dtype=torch.float64)
    one = rollout_metrics(*_scored(stats, compute=penalty), Ranks(), "gsm8k.strict", seconds=0.5)
    two = rollout_metrics(*_scored(stats, compute=penalty), TwoRanks(), "gsm8k.strict", seconds=0.5)
    for key in (m.COMPUTE_MEAN_EXIT, m.COMPUTE_EXIT_ENTROPY, m.COMPUTE_PASSES_PER_TOKEN, m.REWARD_COMPUTE):
        assert two[key] == pytest.approx(one[key]), key
    assert two[m.ROLLOUT_SEQUENCES] == 4 and two[m.THROUGHPUT_GOODPUT] == pytest.approx(2 / 1.0)


def test_occupancy_over_every_pass_and_the_passes_with_rows_waiting():
    """Two chunks of passes joined (3 passes at 1, 0.5, 0.25 of the bound while rows waited, then 1 at 0.5):
    the occupancy averages all four passes, the waiting one the first three; without passes neither key."""
    first = RolloutStats(row_passes=torch.tensor([9]), tokens=3, occupied=1.75, occupied_passes=3,
                         waiting_occupied=1.75, waiting_passes=3)
    last = RolloutStats(row_passes=torch.tensor([4]), tokens=2, occupied=0.5, occupied_passes=1)
    joined = RolloutStats.join([first, last], serial=True, wall_time=0.0)
    metrics = rollout_metrics(*_scored(joined), Ranks(), "gsm8k.strict")
    assert metrics[m.ROLLOUT_OCCUPANCY] == pytest.approx(2.25 / 4)
    assert metrics[m.ROLLOUT_OCCUPANCY_WAITING] == pytest.approx(1.75 / 3)
    assert not m.unknown_keys(metrics)
    alone = rollout_metrics(*_scored(last), Ranks(), "gsm8k.strict")  # no row waited: no waiting key
    assert alone[m.ROLLOUT_OCCUPANCY] == 0.5 and m.ROLLOUT_OCCUPANCY_WAITING not in alone
    vllm = rollout_metrics(*_scored(RolloutStats()), Ranks(), "gsm8k.strict")
    assert m.ROLLOUT_OCCUPANCY not in vllm and m.ROLLOUT_OCCUPANCY_WAITING not in vllm
