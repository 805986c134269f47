"""`NativeEngine(chunk_rows=...)`: a call's rows run in chunks of whole prompts, each with a KV cache
of its own rows and reachable positions; rows keep their random keys, and the merged record
replays chunk by chunk, bitwise.

What equals what (docs/design.md §2.7): in fp32 a chunked call gives the unchunked call's tokens,
exits and finish reasons, and log-probs and gates within the reordering bound derived from the
arithmetic (`ReorderBound`, docs/design.md §3.8): a pass's batch shape (items, the widths and key
lengths attention groups are padded to) changes the order of the additions in matrix products and
attention, and so their rounding, differently on each CPU. In bf16 the same rounding is
one bf16 ulp of a hidden state, which can move a sampled token or an exit decision, so a bf16
chunked call is checked against the engine run on each chunk's prompts as its own call: bitwise.
Replay is bitwise everywhere."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.errors import RlttError
from rltt.orchestration.engines import make_engine
from rltt.orchestration.ray import shards
from rltt.rollout import NativeEngine, RolloutStats, SamplingParams, Schedule, replay_logprobs
from rltt.rollout import executor as executor_module
from rltt.rollout.params import ThinkingBudget
from rltt.rollout.sampler import RowRandom

from .helpers import ReorderBound, assert_same_passes, prompts, tiny_model

#: two evaluations that run the very same operations on the same shapes: bitwise
EXACT = ReorderBound(logprob=0.0, gate=0.0)

LENGTHS = [5, 1, 9, 4, 7]  # five prompts, ragged
N = 2  # samples per prompt: 10 rows
#: one group, not dividing the call (3 + 2 prompts), less than a group, larger than the call
CHUNK_SIZES = [N, 3 * N, 1, 64]
SEEDS = [11, 5, 3, 9, 1]
THINKING = ThinkingBudget(budget=3, close=[59], interruption=[5, 6, 59], answer_budget=3)


def lora_model(dtype=torch.float32):
    model = tiny_model(dtype=dtype, injection="scalar", lora_rank=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def sampling(schedule="deferred", policy="sample", seeded="prompt", thinking=None, **kw):
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=40, max_new_tokens=kw.pop("max_new_tokens", 6), n=N,
                          seed=7, prompt_seeds=list(SEEDS) if seeded == "prompt" else None, exit_policy=policy,
                          schedule=schedule, thinking=thinking, **kw)


def assert_same_rows(got, want, bound: ReorderBound | None = EXACT):
    """Tokens, exits, forced tokens and finish reasons equal; log-probs and gates within ``bound``
    (`EXACT`: bitwise; None: not compared)."""
    for name in ("completion_ids", "completion_lengths", "completion_mask", "exit_steps", "forced_mask",
                 "prompt_index", "prompt_lengths"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.finish_reasons == want.finish_reasons
    assert got.prompts == want.prompts
    assert torch.equal(got.gate_probs.isnan(), want.gate_probs.isnan())
    if bound is None:
        return
    for name in ("logprobs", "tempered_logprobs"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=bound.logprob, rtol=0)
    torch.testing.assert_close(got.gate_probs.nan_to_num(), want.gate_probs.nan_to_num(), atol=bound.gate, rtol=0)


def assert_replays_bitwise(model, batch):
    replay = replay_logprobs(model, batch)
    assert torch.equal(replay.logprobs, batch.logprobs)
    assert torch.equal(replay.tempered_logprobs, batch.tempered_logprobs)


class CacheShapes:
    """Records the shape of every `StepKVCache` the executor allocates (monkeypatched in)."""

    def __init__(self, monkeypatch):
        self.shapes: list[tuple[int, ...]] = []
        original = executor_module.StepKVCache
        recorder = self

        class Recording(original):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                recorder.shapes.append(tuple(self.keys[0].shape))

        monkeypatch.setattr(executor_module, "StepKVCache", Recording)


def expected_shapes(model, lengths, n, chunk_rows, width):
    """(T, rows, Hkv, longest prompt + width, D) per chunk of whole prompts."""
    cfg = model.config
    per = max(1, chunk_rows // n)
    out = []
    for a in range(0, len(lengths), per):
        part = lengths[a:a + per]
        out.append((cfg.num_loops, len(part) * n, cfg.num_key_value_heads, max(part) + width, cfg.head_dim))
    return out


def test_chunks_are_whole_prompts():
    engine = NativeEngine(tiny_model())
    assert engine.chunk_rows is None and engine.chunks(5, 3) == [(0, 5)]
    for chunk_rows, want in [(3, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),  # one group
                             (7, [(0, 2), (2, 4), (4, 5)]),  # 2 prompts (6 rows), not dividing the call
                             (2, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),  # below a group: still one prompt
                             (15, [(0, 5)]), (100, [(0, 5)])]:
        engine.chunk_rows = chunk_rows
        assert engine.chunks(5, 3) == want, chunk_rows


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "auto"])
def test_a_bad_chunk_rows_is_a_one_line_error(bad):
    with pytest.raises(RlttError, match="chunk_rows"):
        NativeEngine(tiny_model(), bad)


def test_a_chunk_keeps_the_calls_row_keys():
    whole = RowRandom(99, "cpu", 12)
    assert torch.equal(whole.take(4, 10).keys, whole.keys[4:10])
    rows, counters = [0, 3, 5], [0, 2, 7]
    for stream in (RowRandom.TOKEN, RowRandom.EXIT):
        assert torch.equal(whole.take(4, 10).uniform(rows, counters, stream),
                           whole.uniform([r + 4 for r in rows], counters, stream))
    # with a call seed a row's key is its index in the call: a separate call of the chunk's rows differs
    assert not torch.equal(RowRandom(99, "cpu", 6).keys, whole.keys[4:10])
    seeded = RowRandom(0, "cpu", 12, prompt_seeds=[3, 1, 4, 1, 5, 9], n=2)
    assert torch.equal(seeded.take(4, 8).keys, RowRandom(0, "cpu", 4, prompt_seeds=[4, 1], n=2).keys)


FP32_CASES = [
    ("dense", "sample", "prompt", None),
    ("deferred", "threshold:0.5", "call", None),
    ("deferred", "sample", "call", THINKING),
    ("dense", "threshold:0.5", "prompt", THINKING),
]


@pytest.mark.parametrize("schedule,policy,seeded,thinking", FP32_CASES,
                         ids=lambda v: "thinking" if isinstance(v, ThinkingBudget) else str(v))
def test_fp32_chunks_give_the_unchunked_rows_and_replay_bitwise(schedule, policy, seeded, thinking):
    model = lora_model()
    batch_prompts = prompts(LENGTHS, seed=3)
    params = sampling(schedule, policy, seeded, thinking)
    whole = NativeEngine(model).generate(batch_prompts, params)
    if thinking is not None:
        assert whole.forced_mask.any()
    assert len(set(whole.exit_steps[whole.action_mask].tolist())) > 1  # mixed exits
    for chunk_rows in CHUNK_SIZES:
        batch = NativeEngine(model, chunk_rows, continuous=False).generate(batch_prompts, params)
        assert_same_rows(batch, whole, ReorderBound.of(model, params.temperature))
        assert batch.params == whole.params  # the seed drawn or given, recorded once
        assert_replays_bitwise(model, batch)
        chunks = NativeEngine(model, chunk_rows, continuous=False).chunks(len(batch_prompts), N)
        if len(chunks) == 1:
            assert batch.schedule.chunks is None
            assert_same_passes(batch.schedule, whole.schedule)
            assert torch.equal(batch.logprobs, whole.logprobs)  # one chunk is the unchunked call
        else:
            assert [rows for rows, _ in batch.schedule.chunks] == [(b - a) * N for a, b in chunks]
            assert sum(p for _, p in batch.schedule.chunks) == len(batch.schedule.passes) == batch.stats.passes
        assert batch.stats.tokens == whole.stats.tokens
        assert batch.stats.entries_computed == sum(p.entries() for p in batch.schedule.passes)
        assert batch.stats.row_passes.shape == (batch.num_rows,)


BF16_CASES = [("dense", "sample", None), ("deferred", "threshold:0.5", None), ("deferred", "sample", THINKING)]


@pytest.mark.parametrize("schedule,policy,thinking", BF16_CASES,
                         ids=lambda v: "thinking" if isinstance(v, ThinkingBudget) else str(v))
def test_bf16_chunks_are_the_chunks_run_alone_and_replay_bitwise(schedule, policy, thinking):
    model = lora_model(torch.bfloat16)
    batch_prompts = prompts(LENGTHS, seed=3)
    params = sampling(schedule, policy, "prompt", thinking)
    for chunk_rows in (N, 3 * N):
        engine = NativeEngine(model, chunk_rows, continuous=False)
        batch = engine.generate(batch_prompts, params)
        assert batch.dtype == torch.bfloat16
        alone = [NativeEngine(model).generate(batch_prompts[a:b], shards.shard_params(params, a, b))
                 for a, b in engine.chunks(len(batch_prompts), N)]
        want = shards.merge(alone, params, EXACT)
        assert_same_rows(batch, want, EXACT)
        assert_same_passes(batch.schedule, want.schedule)
        assert_replays_bitwise(model, batch)
        assert_replays_bitwise(model, want)  # the shards' merge replays shard by shard the same way


@pytest.mark.parametrize("thinking", [None, THINKING], ids=["plain", "thinking"])
def test_each_chunk_allocates_a_kv_cache_of_its_rows_and_reachable_positions(monkeypatch, thinking):
    model = tiny_model()
    caches = CacheShapes(monkeypatch)
    batch_prompts = prompts(LENGTHS, seed=3)
    params = sampling("deferred", "sample", "call", thinking)
    width = params.max_new_tokens if thinking is None else max(params.max_new_tokens, thinking.max_completion)
    assert width == (6 if thinking is None else 9)
    for chunk_rows in (4, 3, 64):
        caches.shapes.clear()
        batch = NativeEngine(model, chunk_rows, continuous=False).generate(batch_prompts, params)
        want = expected_shapes(model, LENGTHS, N, chunk_rows, width)
        assert caches.shapes == want, chunk_rows
        if chunk_rows == 4:  # prompts (5, 1), (9, 4), (7): 4, 4 and 2 rows
            assert [s[1] for s in want] == [4, 4, 2] and [s[3] for s in want] == [5 + width, 9 + width, 7 + width]
        caches.shapes.clear()
        replay_logprobs(model, batch)  # replay runs the chunks on executors of the same rows
        assert [s[1] for s in caches.shapes] == [s[1] for s in want]


def test_the_kv_cache_stops_at_the_last_position_a_row_can_write(monkeypatch):
    model = tiny_model()  # max_position_embeddings = 64
    caches = CacheShapes(monkeypatch)
    long_prompts = prompts([60, 3], seed=1)
    params = SamplingParams(max_new_tokens=10, n=2, seed=1, ignore_eos=True, exit_policy="sample")
    batch = NativeEngine(model, 2, continuous=False).generate(long_prompts, params)
    assert [s[3] for s in caches.shapes] == [65, 13]  # 60 + 10 capped at position 64 (+1); 3 + 10
    assert batch.completion(0) and len(batch.completion(0)) == 5  # finished at the model's last position
    assert batch.finish_reasons[:2] == ["length", "length"]
    whole = NativeEngine(model).generate(long_prompts, params)
    assert_same_rows(batch, whole, ReorderBound.of(model, params.temperature))
    assert_replays_bitwise(model, batch)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), n=st.integers(1, 3),
       chunk_rows=st.integers(1, 12), seed=st.integers(0, 1000))
def test_any_chunking_keeps_the_rows_and_replays_bitwise(lengths, n, chunk_rows, seed):
    model = tiny_model()
    batch_prompts = prompts(lengths, seed=seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=n, seed=seed, exit_policy="sample")
    whole = NativeEngine(model).generate(batch_prompts, params)
    shapes: list[tuple[int, ...]] = []
    original = executor_module.StepKVCache

    class Recording(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            shapes.append(tuple(self.keys[0].shape))

    executor_module.StepKVCache = Recording
    try:
        batch = NativeEngine(model, chunk_rows, continuous=False).generate(batch_prompts, params)
    finally:
        executor_module.StepKVCache = original
    assert shapes == expected_shapes(model, lengths, n, chunk_rows, 5)
    assert_same_rows(batch, whole, ReorderBound.of(model, params.temperature))
    assert_replays_bitwise(model, batch)


def test_a_chunked_schedule_travels_and_merges_into_nested_chunks():
    import pickle

    model = tiny_model()
    engine = NativeEngine(model, N, continuous=False)
    batch_prompts = prompts(LENGTHS, seed=3)
    params = sampling("deferred", "sample", "prompt")
    batch = engine.generate(batch_prompts, params)
    assert len(batch.schedule.chunks) == len(LENGTHS)
    for copied in (pickle.loads(pickle.dumps(batch.schedule)), pickle.loads(pickle.dumps(batch)).schedule):
        assert_same_passes(copied, batch.schedule)
    # a Ray pool's shards, each chunked by its worker's engine: the merge keeps every chunk
    a = engine.generate(batch_prompts[:3], shards.shard_params(params, 0, 3))
    b = engine.generate(batch_prompts[3:], shards.shard_params(params, 3, 5))
    merged = shards.merge([a, b], params, EXACT)
    assert merged.stats.passes == max(a.stats.passes, b.stats.passes)  # shards run side by side
    assert_same_passes(merged.schedule, batch.schedule)  # the same chunks: the same record
    assert_same_rows(merged, batch, EXACT)
    assert_replays_bitwise(model, merged)
    # a shard without chunks is one chunk of the merge
    whole_b = NativeEngine(model).generate(batch_prompts[3:], shards.shard_params(params, 3, 5))
    assert whole_b.schedule.chunks is None
    merged = shards.merge([a, whole_b], params, EXACT)
    assert merged.schedule.chunks == [*a.schedule.chunks, (2 * N, len(whole_b.schedule.passes))]
    assert_same_rows(merged, batch, ReorderBound.of(model, params.temperature))
    assert_replays_bitwise(model, merged)
    # a record whose chunks do not cover its rows is refused
    broken = replace(batch, schedule=replace(batch.schedule, chunks=batch.schedule.chunks[:-1]))
    with pytest.raises(RlttError, match="chunks cover"):
        replay_logprobs(model, broken)


def test_stats_join_serial_chunks_and_side_by_side_shards():
    parts = [RolloutStats(passes=5, row_passes=torch.tensor([5, 4]), entries_computed=10, entries_pending=1,
                          tokens=6),
             RolloutStats(passes=3, row_passes=torch.tensor([3]), entries_computed=4, entries_pending=0, tokens=2)]
    serial = RolloutStats.join(parts, serial=True, wall_time=1.5)
    assert (serial.passes, serial.entries_computed, serial.entries_pending, serial.tokens, serial.wall_time) == \
        (8, 14, 1, 8, 1.5)
    assert serial.row_passes.tolist() == [5, 4, 3]
    assert RolloutStats.join(parts, serial=False, wall_time=0.0).passes == 5
    assert RolloutStats.join([parts[0], RolloutStats()], serial=True, wall_time=0.0).row_passes is None
    assert Schedule("dense").chunk_spans(3) == [(0, 3, 0, 0)]


def test_the_recipe_section_sets_the_engines_chunk_rows():
    from rltt.orchestration.train_recipe import RolloutSection

    model = tiny_model()
    assert make_engine({"engine": "native", "chunk_rows": 6}, model).chunk_rows == 6
    assert make_engine({"engine": "native", "chunk_rows": "auto"}, model).chunk_rows is None
    assert make_engine({"engine": "native"}, model).chunk_rows is None
    assert make_engine(RolloutSection(group_size=2, chunk_rows=4), model).chunk_rows == 4
    assert make_engine(RolloutSection(), model).chunk_rows is None  # auto: `rltt train` resolves it first


def test_a_train_run_chunked_by_one_group_logs_the_default_runs_metrics(tmp_path):
    """3 steps of `rltt train` (held-out evaluation included, same engine) with
    ``rollout.chunk_rows`` = one group against the default (``auto``: one chunk here): every
    metric equal, except the sampler–learner mismatch, which reads the sampler's log-probs
    (equal within fp32 rounding, see the module docstring)."""
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.orchestration.trainer import Trainer
    from rltt.telemetry import read_metrics

    from ..orchestration.test_local import write_recipe

    runs = {}
    for name, overrides in (("default", []), ("chunked", ["rollout.chunk_rows=3"])):
        trainer = Trainer(load_train_recipe(write_recipe(tmp_path / name), overrides), recipe_root=tmp_path / name)
        assert trainer.engine.chunk_rows == (6 if name == "default" else 3)  # 2 prompts x group of 3
        trainer.run()
        runs[name] = read_metrics(tmp_path / name / "run")
    default, chunked = runs["default"], runs["chunked"]
    assert [r["step"] for r in default] == [r["step"] for r in chunked] == [0, 1, 2, 3]
    # rollout/occupancy*: how full the passes were, which chunking changes by design (one chunk: no row
    # ever waits, so no rollout/occupancy_waiting)
    timing = ("time/", "throughput/", "memory/", "wall_time", "rollout/occupancy")
    for want, got in zip(default, chunked):
        assert {k for k in want if not k.startswith(timing[-1])} == {k for k in got if not k.startswith(timing[-1])}
        assert ("rollout/occupancy_waiting" in got) == ("rollout/occupancy" in got)
        for key in want:
            if key.startswith(timing):
                continue
            if key.startswith("mismatch/"):
                assert got[key] == pytest.approx(want[key], abs=1e-6), key
            else:
                assert got[key] == want[key], (want["step"], key)
