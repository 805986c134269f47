"""`Schedule`'s pickled form (how a Ray rollout worker's batch travels): its passes as a few flat
tensors, rebuilt on load into passes equal to the originals, a fraction of the per-pass size,
and a round-tripped batch still replays bitwise."""

import copy
import pickle

import pytest
import torch

from rltt.rollout import NativeEngine, PassRecord, SamplingParams, Schedule, replay_logprobs

from .helpers import assert_same_passes, prompts, tiny_model


def roundtrip(obj):
    return pickle.loads(pickle.dumps(obj, protocol=5))


def rollout(schedule: str = "deferred", n: int = 4):
    model = tiny_model()
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=n, seed=5, exit_policy="sample",
                            schedule=schedule)
    return model, NativeEngine(model).generate(prompts([5, 3, 7]), params)


@pytest.mark.parametrize("schedule", ["deferred", "dense"])
def test_a_native_rollouts_schedule_round_trips_to_equal_passes(schedule):
    _, batch = rollout(schedule)
    passes = batch.schedule.passes
    assert any(p.fork is not None for p in passes) and any(p.fork is None for p in passes)
    assert any(not p.exits.numel() for p in passes) and any(p.exits.numel() for p in passes)
    for copied in (roundtrip(batch.schedule), copy.deepcopy(batch.schedule), roundtrip(batch).schedule):
        assert_same_passes(copied, batch.schedule)
        assert sum(p.entries() for p in copied.passes) == batch.stats.entries_computed


def test_the_pickled_schedule_is_a_small_fraction_of_its_passes_pickled_one_by_one():
    _, batch = rollout(n=8)
    assert len(batch.schedule.passes) > 20
    compact = len(pickle.dumps(batch.schedule, protocol=5))
    per_record = len(pickle.dumps(batch.schedule.passes, protocol=5))
    assert compact < 0.2 * per_record, (compact, per_record)


def test_a_round_tripped_batch_replays_bitwise():
    model, batch = rollout()
    copied = roundtrip(batch)
    replay = replay_logprobs(model, copied)
    assert torch.equal(replay.logprobs, batch.logprobs)
    assert torch.equal(replay.tempered_logprobs, batch.tempered_logprobs)
    assert (batch.logprobs[batch.completion_mask] < 0).all()


def long(rows):
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 4)


@pytest.mark.parametrize("schedule", [
    Schedule("deferred"),  # no passes
    Schedule("vllm"),  # vLLM records none: its kind alone travels
    Schedule("dense", [PassRecord(long([]), torch.zeros(0, dtype=torch.long))]),  # a pass with no work
    Schedule("deferred", [  # a fork on a middle pass, one with no rows, exits empty and not
        PassRecord(long([[0, 0, 3, 1], [2, 0, 3, 1]]), torch.zeros(0, dtype=torch.long)),
        PassRecord(long([[0, 0, 3, 2]]), torch.zeros(0, dtype=torch.long),
                   fork=torch.tensor([[0, 1, 4], [0, 3, 4]])),
        PassRecord(long([[1, 4, 4, 1], [3, 4, 4, 1]]), torch.tensor([3, 1]),
                   fork=torch.zeros((0, 3), dtype=torch.long)),
        PassRecord(long([[1, 5, 5, 1]]), torch.tensor([1]), fork=None),
    ]),
    Schedule("deferred", [  # values past int16/int32 survive the narrowed transport
        PassRecord(long([[70000, 1, 2**40, 1]]), torch.tensor([-(2**33)])),
        PassRecord(long([[1, -129, 128, 4]]), torch.tensor([127, -128])),
    ]),
    Schedule("dense", [  # another integer dtype is kept as it was
        PassRecord(torch.tensor([[0, 0, 1, 1]], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)),
        PassRecord(torch.tensor([[1, 0, 300, 2]], dtype=torch.int32), torch.tensor([], dtype=torch.int32)),
    ]),
    Schedule("dense", [  # mixed dtypes or shapes: pickled pass by pass, still equal
        PassRecord(long([[0, 0, 1, 1]]), torch.tensor([0])),
        PassRecord(torch.tensor([[1, 0, 1, 1]], dtype=torch.int32), torch.tensor(0)),
    ]),
], ids=["empty", "vllm", "no-work", "forks", "wide-values", "int32", "mixed"])
def test_edge_schedules_round_trip(schedule):
    copied = roundtrip(schedule)
    assert_same_passes(copied, schedule)
    assert_same_passes(copy.deepcopy(schedule), schedule)


def test_a_rebuilt_schedule_is_a_working_schedule():
    _, batch = rollout()
    copied = roundtrip(batch.schedule)
    copied.passes.append(PassRecord(long([[0, 1, 1, 1]]), torch.tensor([0])))  # still a plain list
    again = roundtrip(copied)
    assert_same_passes(again, copied)
    assert len(again.passes) == len(batch.schedule.passes) + 1
