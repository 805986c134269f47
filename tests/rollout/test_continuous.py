"""Continuous batching in the native engine (`rltt.rollout.admission.Continuous` on the decode loop):
rows of later prompts take the slots of finished rows. The rows keep their meaning (prompt-major, their own random keys: the tokens of
the unchunked call), the record replays bit for bit (fp32 and bf16, dense and deferred, thinking
budgets, pickled, joined as a Ray pool's shard), each shared prompt prefix is computed once, the KV
cache is one executor of ``chunk_rows`` slots, and the occupancy counts what the passes held."""

from __future__ import annotations

import pickle

import pytest
import torch

from rltt.errors import RlttError
from rltt.orchestration.ray import shards
from rltt.rollout import NativeEngine, replay_logprobs

from .helpers import ReorderBound, assert_same_passes, prompts, tiny_model
from .test_chunking import (EXACT, FP32_CASES, LENGTHS, N, THINKING, CacheShapes, assert_replays_bitwise,
                            assert_same_rows, lora_model, sampling)


def assert_same_rows_fp32(model, got, want):
    """Tokens, exits, forced tokens, finish reasons and NaN pattern equal; the passes batch other rows
    together, so log-probs and gates within the reordering bound (`ReorderBound`)."""
    assert_same_rows(got, want, ReorderBound.of(model, got.params.temperature))


@pytest.mark.parametrize("schedule,policy,seeded,thinking", FP32_CASES,
                         ids=lambda v: "thinking" if not isinstance(v, str) and v is not None else str(v))
def test_fp32_continuous_rows_are_the_unchunked_rows_and_replay_bitwise(schedule, policy, seeded, thinking):
    model = lora_model()
    batch_prompts = prompts(LENGTHS, seed=3)
    params = sampling(schedule, policy, seeded, thinking)
    whole = NativeEngine(model).generate(batch_prompts, params)
    for slots in (1, 3, 2 * N + 1):  # one slot, fewer than a group's... slots not a multiple of a group
        batch = NativeEngine(model, slots, continuous=True).generate(batch_prompts, params)
        assert any(p.admit is not None for p in batch.schedule.passes[1:])  # rows joined later passes
        assert_same_rows_fp32(model, batch, whole)  # each row drew its own key's numbers, in prompt-major order
        assert batch.params == whole.params
        assert_replays_bitwise(model, batch)
        assert batch.stats.tokens == whole.stats.tokens
        assert batch.stats.passes == len(batch.schedule.passes)
        assert batch.stats.entries_computed == sum(p.entries() for p in batch.schedule.passes)
        assert batch.stats.row_passes.shape == (batch.num_rows,)
        # every pass held at most ``slots`` rows, and the occupancy is what the record says
        live = [len(p.work) for p in batch.schedule.passes]
        assert max(live) <= slots
        assert batch.stats.occupancy == pytest.approx(sum(live) / slots / len(live))


@pytest.mark.parametrize("schedule,policy,thinking", [("dense", "sample", None), ("deferred", "threshold:0.5", None),
                                                      ("deferred", "sample", THINKING)],
                         ids=["dense", "deferred", "deferred-thinking"])
def test_bf16_continuous_replays_bitwise(schedule, policy, thinking):
    model = lora_model(torch.bfloat16)
    params = sampling(schedule, policy, "prompt", thinking, max_new_tokens=8)
    for slots in (2, 5):
        batch = NativeEngine(model, slots, continuous=True).generate(prompts(LENGTHS, seed=3), params)
        assert batch.dtype == torch.bfloat16
        assert_replays_bitwise(model, batch)


def test_stop_tokens_free_slots_and_replay_bitwise():
    model = lora_model()
    batch_prompts = prompts(LENGTHS, seed=3)
    params = sampling("deferred", "sample", "prompt", stop_token_ids=[7, 11, 13, 17, 19, 23, 29], max_new_tokens=12)
    whole = NativeEngine(model).generate(batch_prompts, params)
    assert "stop" in whole.finish_reasons
    batch = NativeEngine(model, 3, continuous=True).generate(batch_prompts, params)
    assert_same_rows_fp32(model, batch, whole)
    assert_replays_bitwise(model, batch)


def test_each_shared_prefix_is_computed_once_and_rows_are_admitted_one_by_one():
    model = tiny_model()
    lengths = [5, 1, 9, 4, 7]
    batch_prompts = prompts(lengths, seed=3)
    params = sampling("deferred", "sample", "call", max_new_tokens=5)
    batch = NativeEngine(model, 3, continuous=True).generate(batch_prompts, params)
    T = model.config.num_loops
    prefill = {}  # prompt → its prefix ranges (start 0, end P−2, no exit): one per step
    admitted = []
    slot_row = {}
    for record in batch.schedule.passes:
        if record.admit is not None:
            for slot, row, _, _ in record.admit.tolist():
                slot_row[slot] = row
                admitted.append(row)
        exits = set(record.exits.tolist())
        for slot, start, end, step in record.work.tolist():
            P = lengths[slot_row[slot] // N]
            if start == 0 and end == P - 2 and P >= 2 and slot not in exits:
                prefill.setdefault(slot_row[slot] // N, []).append(step)
    assert admitted == list(range(batch.num_rows))  # prompt-major, each row once
    assert sorted(prefill) == [i for i, P in enumerate(lengths) if P >= 2]  # prompts of one token have none
    for steps in prefill.values():
        assert steps == list(range(1, T + 1))
    # admissions after the first pass come one by one as rows finish: never more than the rows that
    # finished in the pass before
    sizes = [len(p.admit) for p in batch.schedule.passes if p.admit is not None]
    assert sizes[0] == 3 and len(sizes) > 3


def test_one_kv_cache_of_the_slots_and_the_calls_longest_prompt(monkeypatch):
    model = tiny_model()
    caches = CacheShapes(monkeypatch)
    params = sampling("deferred", "sample", "call", THINKING)
    width = max(params.max_new_tokens, THINKING.max_completion)
    batch = NativeEngine(model, 4, continuous=True).generate(prompts(LENGTHS, seed=3), params)
    cfg = model.config
    assert caches.shapes == [(cfg.num_loops, 4, cfg.num_key_value_heads, max(LENGTHS) + width, cfg.head_dim)]
    caches.shapes.clear()
    replay_logprobs(model, batch)
    assert [s[1] for s in caches.shapes] == [4]  # replay runs the same slots


def test_a_continuous_schedule_travels_and_joins_as_a_shard():
    model = tiny_model()
    engine = NativeEngine(model, 3, continuous=True)
    batch_prompts = prompts(LENGTHS, seed=3)
    params = sampling("deferred", "sample", "prompt")
    batch = engine.generate(batch_prompts, params)
    for copied in (pickle.loads(pickle.dumps(batch.schedule)), pickle.loads(pickle.dumps(batch)).schedule):
        assert_same_passes(copied, batch.schedule)
    assert_replays_bitwise(model, pickle.loads(pickle.dumps(batch)))
    # a Ray pool's shards, each a continuous call: the second's slots and rows move past the first's rows
    a = engine.generate(batch_prompts[:2], shards.shard_params(params, 0, 2))
    b = engine.generate(batch_prompts[2:], shards.shard_params(params, 2, 5))
    merged = shards.merge([a, b], params, 0.0)
    assert merged.schedule.passes[len(a.schedule.passes)].admit[0, :2].tolist() == [2 * N, 2 * N]
    assert_same_rows(merged, batch, None)
    assert_replays_bitwise(model, merged)


def test_without_a_row_bound_or_with_room_for_every_row_it_is_the_plain_call():
    model = tiny_model()
    batch_prompts = prompts(LENGTHS, seed=3)
    params = sampling("deferred", "sample", "prompt")
    plain = NativeEngine(model).generate(batch_prompts, params)
    for engine in (NativeEngine(model, continuous=True), NativeEngine(model, 64, continuous=True)):
        batch = engine.generate(batch_prompts, params)
        assert_same_passes(batch.schedule, plain.schedule)
        assert_same_rows(batch, plain, EXACT)
    with pytest.raises(RlttError, match="continuous"):
        NativeEngine(model, 4, continuous="yes")


def test_chunked_calls_count_their_occupancy():
    model = tiny_model()
    params = sampling("deferred", "sample", "prompt")
    batch = NativeEngine(model, 2 * N, continuous=False).generate(prompts(LENGTHS, seed=3), params)
    live = [len(p.work) for p in batch.schedule.passes]
    assert batch.stats.occupancy == pytest.approx(sum(live) / (2 * N) / len(live))
    last = batch.schedule.chunks[-1][1]  # the last chunk's passes: no row waits any more
    assert batch.stats.waiting_passes == len(live) - last
    assert batch.stats.occupancy_waiting == pytest.approx(sum(live[:-last]) / (2 * N) / (len(live) - last))


def test_the_recipe_key_is_on_by_default_and_false_keeps_chunks_on_the_native_engine_only():
    from rltt.orchestration.engines import make_engine
    from rltt.orchestration.train_recipe import RolloutSection

    model = tiny_model()
    assert make_engine({"engine": "native", "chunk_rows": 4}, model).continuous  # on by default
    assert not make_engine({"engine": "native", "chunk_rows": 4, "continuous_batching": False}, model).continuous
    assert make_engine(RolloutSection(group_size=2, chunk_rows=4), model).continuous
    assert not make_engine(RolloutSection(group_size=2, chunk_rows=4, continuous_batching=False), model).continuous
    RolloutSection(group_size=2, chunk_rows=4, continuous_batching=False).validate()
    RolloutSection(engine="vllm", schedule="dense").validate()  # vLLM batches continuously: the default holds
    with pytest.raises(RlttError, match="rollout.continuous_batching"):
        RolloutSection(engine="vllm", schedule="dense", continuous_batching=False).validate()
    with pytest.raises(RlttError, match="rollout.continuous_batching"):
        make_engine({"engine": "native", "continuous_batching": "yes"}, model)
