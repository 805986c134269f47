"""What both rollout engines share: the row record and rows into a `RolloutBatch` (padding, forced
tokens, finish reasons, gates), the stop-token set, the prompt-seed check, the stop-string rule, and
whether a batch's schedule can be replayed (`Schedule.replayable`, `RolloutEngine.replayable`)."""

import pickle
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rltt.errors import RlttError
from rltt.orchestration.ray import shards
from rltt.rollout import (NativeEngine, PassRecord, RolloutBatch, RolloutEngine, RolloutStats, SamplingParams,
                          Schedule, replay_logprobs)
from rltt.rollout.rows import Row, rows_batch
from rltt.rollout.params import stop_token_set

from .helpers import prompts, tiny_model

NAN = float("nan")
FIELDS = ("prompt_index", "prompt_lengths", "completion_ids", "completion_lengths", "completion_mask",
          "exit_steps", "logprobs", "tempered_logprobs", "gate_probs", "forced_mask")


def assert_same_batch(got: RolloutBatch, want: RolloutBatch) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.isnan(), b.isnan()) if a.is_floating_point() else True, name
        assert torch.equal(a.nan_to_num(-9.0), b.nan_to_num(-9.0)), name
    assert got.finish_reasons == want.finish_reasons
    assert got.prompts == want.prompts and got.pad_id == want.pad_id and got.dtype == want.dtype
    assert got.num_loops == want.num_loops
    assert got.schedule is want.schedule and got.params is want.params and got.stats is want.stats


def three_rows(gates=None) -> list[Row]:
    """A stopped row, a forced row (sampled, interruption, sampled) and a row with no tokens;
    ``gates(r, n)``: the (T, n) gates of row r's n tokens, added once its tokens are in."""
    stopped = Row()
    for token, step, lp in ((4, 2, -0.5), (9, 1, -1.25), (3, 3, -0.125)):
        stopped.add(token, step, lp, lp / 2)
    stopped.finish = "stop"
    forced = Row()
    forced.add(5, 1, -2.0, -1.0)
    forced.force([7, 8])
    forced.extend([6], [2], [-0.75], [-0.375])
    rows = [stopped, forced, Row()]
    if gates is not None:
        for r, row in enumerate(rows):
            row.add_gates(gates(r, len(row)))
    return rows


def test_rows_batch_pads_rows_forced_tokens_and_finish_reasons():
    def gates(r, n):  # row r's (T=2, n) gates: 10r + token index at step 1, negated at step 2
        values = torch.arange(n, dtype=torch.float32) + 10 * r
        return torch.stack([values, -values])

    rows = three_rows(gates)
    assert rows[1].ids == [5, 7, 8, 6] and rows[1].column("forced_mask") == [0, 1, 1, 0]
    assert rows[1].column("exit_steps") == [1, 0, 0, 2] and rows[1].column("logprobs") == [-2.0, 0.0, 0.0, -0.75]
    prompt_list = [[1, 2], [3, 4, 5]]
    schedule, params, stats = Schedule("dense"), SamplingParams(seed=3), RolloutStats(tokens=7)
    got = rows_batch(prompt_list, [0, 1, 1], rows, schedule=schedule, params=params, stats=stats,
                     num_loops=2, dtype=torch.bfloat16, pad_id=60)
    lengths = torch.tensor([3, 4, 0])
    want = RolloutBatch(
        prompts=prompt_list, prompt_index=torch.tensor([0, 1, 1]), prompt_lengths=torch.tensor([2, 3, 3]),
        completion_ids=torch.tensor([[4, 9, 3, 60], [5, 7, 8, 6], [60, 60, 60, 60]]),
        completion_lengths=lengths, completion_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]).bool(),
        exit_steps=torch.tensor([[2, 1, 3, 0], [1, 0, 0, 2], [0, 0, 0, 0]]),
        logprobs=torch.tensor([[-0.5, -1.25, -0.125, 0], [-2.0, 0, 0, -0.75], [0, 0, 0, 0]]),
        tempered_logprobs=torch.tensor([[-0.25, -0.625, -0.0625, 0], [-1.0, 0, 0, -0.375], [0, 0, 0, 0]]),
        gate_probs=torch.tensor([[[0, 1, 2, NAN], [10, 11, 12, 13], [NAN] * 4],
                                 [[0, -1, -2, NAN], [-10, -11, -12, -13], [NAN] * 4]]),
        finish_reasons=["stop", "length", "length"], schedule=schedule, params=params, stats=stats,
        num_loops=2, dtype=torch.bfloat16, pad_id=60,
        forced_mask=torch.tensor([[0, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]]).bool(),
    )
    assert_same_batch(got, want)
    assert got.completion(1) == [5, 7, 8, 6] and got.completion(2) == []
    assert got.action_mask.sum() == 5  # the forced interruption is no action


def test_rows_batch_without_tokens_or_gates():
    """At least one column even when no row has a token; no gates: all NaN."""
    got = rows_batch([[1]], [0, 0], [Row(), Row()], schedule=Schedule("vllm"),
                     params=SamplingParams(), stats=RolloutStats(), num_loops=3, dtype=torch.float32,
                     pad_id=0)
    assert got.completion_ids.shape == (2, 1) and not got.completion_mask.any()
    assert got.gate_probs.shape == (3, 2, 1) and got.gate_probs.isnan().all()
    rows = three_rows()[:1]
    got = rows_batch([[1]], [0], rows, schedule=Schedule("vllm"), params=SamplingParams(),
                     stats=RolloutStats(), num_loops=3, dtype=torch.float32, pad_id=0)
    assert got.gate_probs.isnan().all() and got.completion(0) == [4, 9, 3]


@pytest.mark.parametrize("eos,ignore_eos,want", [
    (None, False, {5, 9}),
    (2, False, {2, 5, 9}),
    ([2, 9, 11], False, {2, 5, 9, 11}),
    (2, True, {5, 9}),
    ([2, 11], True, {5, 9}),
])
def test_stop_token_set(eos, ignore_eos, want):
    params = SamplingParams(stop_token_ids=[9, 5], ignore_eos=ignore_eos)
    assert stop_token_set(params, SimpleNamespace(eos_token_id=eos)) == want
    assert stop_token_set(SamplingParams(ignore_eos=ignore_eos), SimpleNamespace(eos_token_id=None)) == set()


def test_stop_string_in():
    decode = lambda ids: "".join(chr(ord("a") + t) for t in ids)  # noqa: E731
    params = SamplingParams(stop_strings=["cd", "zz"], decoder=decode)
    assert not params.stop_string_in([0, 1, 2]) and params.stop_string_in([0, 2, 3])
    assert not SamplingParams().stop_string_in([0, 2, 3])  # no stop strings: the decoder is never needed


def test_prompt_seed_check_message():
    SamplingParams().check_prompt_seeds(3)
    SamplingParams(prompt_seeds=[1, 2, 3]).check_prompt_seeds(3)
    with pytest.raises(RlttError) as err:
        SamplingParams(prompt_seeds=[1, 2]).check_prompt_seeds(3)
    assert str(err.value) == "SamplingParams.prompt_seeds: 2 seeds for 3 prompts"


def test_native_engine_and_ray_pool_check_prompt_seeds():
    engine = NativeEngine(tiny_model())
    with pytest.raises(RlttError, match=r"^SamplingParams\.prompt_seeds: 1 seeds for 2 prompts$"):
        engine.generate(prompts([2, 3]), SamplingParams(prompt_seeds=[4]))
    pytest.importorskip("ray")
    from rltt.orchestration.ray.rollout_pool import RayRolloutPool

    pool = SimpleNamespace(workers=[None, None])  # the check comes before any worker is called
    with pytest.raises(RlttError, match=r"^SamplingParams\.prompt_seeds: 3 seeds for 2 prompts$"):
        RayRolloutPool.submit(pool, prompts([2, 3]), SamplingParams(prompt_seeds=[4, 5, 6]))


class _Engine(RolloutEngine):
    def generate(self, prompts, params):
        raise NotImplementedError

    def load_weights(self, version, tensors):
        raise NotImplementedError


def test_engine_interface_defaults():
    engine = _Engine()
    assert engine.replayable is False and RolloutEngine.replayable is False
    assert engine.close() is None
    assert NativeEngine.replayable is True
    assert Schedule("dense").replayable is False  # a record nobody vouched for is never replayed


def test_a_native_batch_is_replayable_and_stays_so_through_pickle_and_merge():
    model = tiny_model()
    params = SamplingParams(max_new_tokens=6, n=2, prompt_seeds=[3, 4], exit_policy="sample")
    engine = NativeEngine(model)
    batch = engine.generate(prompts([3, 5]), params)
    assert batch.schedule.replayable and batch.schedule.passes
    assert torch.equal(replay_logprobs(model, batch).logprobs, batch.logprobs)
    assert pickle.loads(pickle.dumps(batch.schedule)).replayable
    odd = Schedule("dense", [PassRecord(torch.zeros((1, 4), dtype=torch.long), torch.zeros(0, dtype=torch.int32)),
                             PassRecord(torch.zeros((0, 3), dtype=torch.long), torch.zeros(0, dtype=torch.long))],
                   replayable=True)  # pickled pass by pass
    assert pickle.loads(pickle.dumps(odd)).replayable
    a = engine.generate(prompts([3, 5])[:1], replace(params, prompt_seeds=[3]))
    b = engine.generate(prompts([3, 5])[1:], replace(params, prompt_seeds=[4]))
    merged = shards.merge([a, b], params, 0.0)
    assert merged.schedule.replayable and merged.schedule.kind == batch.schedule.kind
    assert torch.equal(replay_logprobs(model, merged).logprobs, merged.logprobs)


def test_a_vllm_batch_is_not_replayable():
    """`VllmEngine._to_batch` on a stand-in engine (no vLLM started): rows stitched from segments
    with a forced interruption (NaN gates), a schedule that refuses replay, also once merged."""
    from rltt.vllm.vllm_engine import VllmEngine, _append, _Segment

    assert VllmEngine.replayable is False
    engine = object.__new__(VllmEngine)
    engine.num_loops, engine.config = 2, SimpleNamespace(pad_token_id=None)
    engine.llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    record = {"exits": [1, 2], "raw": [-1.0, -2.0], "tempered": [-0.5, -1.0], "gates": [[0.25, 0.5], [0.75, 1.0]]}
    first, second = Row(), Row()
    _append(first, _Segment([4, 6], record, "length"))
    first.force([9], engine.num_loops)
    _append(first, _Segment([5], record, "stop"))
    _append(second, _Segment([8], record, "length"))
    batch = engine._to_batch([[1, 2], [3]], [0, 1], [first, second], SamplingParams(seed=1), RolloutStats())
    assert batch.completion_ids.tolist() == [[4, 6, 9, 5], [8, 0, 0, 0]]
    assert batch.forced_mask.tolist() == [[False, False, True, False], [False] * 4]
    assert batch.exit_steps.tolist() == [[1, 2, 0, 1], [1, 0, 0, 0]]
    assert batch.finish_reasons == ["stop", "length"]
    assert torch.equal(batch.gate_probs[:, 0, :2], torch.tensor([[0.25, 0.75], [0.5, 1.0]]))
    assert batch.gate_probs[:, 0, 2].isnan().all() and batch.gate_probs[:, 1, 1:].isnan().all()
    assert batch.stats.passes == 8 and batch.stats.row_passes.tolist() == [8, 2]
    assert batch.schedule.kind == "vllm" and not batch.schedule.replayable and not batch.schedule.passes
    assert not pickle.loads(pickle.dumps(batch.schedule)).replayable
    merged = shards.merge([batch, batch], batch.params, 0.0)
    for refused in (batch, merged):
        with pytest.raises(RlttError, match="vLLM rollout has no pass record"):
            replay_logprobs(tiny_model(num_loops=2), refused)


def test_merged_shards_keep_the_forced_tokens_of_a_thinking_budget():
    """A Ray pool merges its workers' shards: forced (interruption) tokens stay non-actions."""
    from rltt.rollout.params import ThinkingBudget

    model = tiny_model()
    thinking = ThinkingBudget(budget=2, close=[60], interruption=[59, 60], answer_budget=2)
    params = SamplingParams(max_new_tokens=6, n=2, prompt_seeds=[3, 4], exit_policy="sample", thinking=thinking)
    engine = NativeEngine(model)
    whole = engine.generate(prompts([3, 5]), params)
    assert whole.forced_mask.any()
    a = engine.generate(prompts([3, 5])[:1], replace(params, prompt_seeds=[3]))
    b = engine.generate(prompts([3, 5])[1:], replace(params, prompt_seeds=[4]))
    merged = shards.merge([a, b], params, 0.0)
    width = whole.forced_mask.shape[1]
    assert torch.equal(merged.forced_mask[:, :width], whole.forced_mask)
    assert torch.equal(merged.action_mask[:, :width], whole.action_mask)


def test_the_field_table_is_every_per_token_tensor_of_a_batch():
    """`TOKEN_FIELDS` names every (R, C) / (T, R, C) tensor a rollout holds (the completion mask is
    the lengths'): a per-token attribute added to `RolloutBatch` without its table entry fails here."""
    from rltt.rollout.rollout_batch import TOKEN_FIELDS

    model = tiny_model()
    batch = NativeEngine(model).generate(prompts([3, 5]), SamplingParams(max_new_tokens=4, n=2, seed=1,
                                                                         exit_policy="sample"))
    batch.versions = torch.zeros_like(batch.completion_ids)  # an optional field, recorded
    shape = tuple(batch.completion_ids.shape)
    per_token = {name for name, value in vars(batch).items()
                 if isinstance(value, torch.Tensor) and tuple(value.shape[-2:]) == shape}
    assert per_token - {"completion_mask"} == {f.name for f in TOKEN_FIELDS}


def test_a_field_added_to_the_table_reaches_every_path(monkeypatch):
    """Adding a per-token field is its table entry (and the batch's attribute, beside it): the row
    record, the builder, a turn taken from a batch, the join of shards, a partial row's checkpoint
    form and the memory plan's per-token bytes all follow, with no other change."""
    from dataclasses import dataclass

    from rltt.orchestration.ray.partial_rows import PartialRow
    from rltt.planning.partial_buffer import PartialBuffer
    from rltt.rollout import rollout_batch, rows as rows_module
    from rltt.rollout.rollout_batch import TOKEN_FIELDS, TokenField, join_batches

    @dataclass
    class Wider(RolloutBatch):
        novel: torch.Tensor | None = None

    table = TOKEN_FIELDS + (TokenField("novel", "q", torch.long, -3, 7),)
    bytes_before = rows_module.token_bytes(2)
    for module in (rollout_batch, rows_module):
        monkeypatch.setattr(module, "TOKEN_FIELDS", table)
        monkeypatch.setattr(module, "RolloutBatch", Wider)
    assert rows_module.token_bytes(2) == bytes_before + 8
    assert PartialBuffer(groups=1, group_size=1, tokens=1, loops=2).per_token == bytes_before + 8
    row = Row()
    row.add(4, 1, -0.5, -0.25)
    row.force([9])
    row.add_env([11], 2)
    row.add_gates(torch.tensor([[0.5, 0.5], [0.25, 0.25]]))
    assert row.column("novel") == [-3, 7, 7]  # sampled: padding; forced and environment's: unsampled
    batch = rows_batch([[1, 2]], [0], [row], schedule=Schedule("dense"), params=SamplingParams(),
                       stats=RolloutStats(), num_loops=2, dtype=torch.float32, pad_id=0)
    assert isinstance(batch, Wider) and batch.novel.tolist() == [[-3, 7, 7]]
    batch.novel = torch.tensor([[5, 6, 7]])
    taken = Row()
    taken.take(batch, 0, 2)
    assert taken.column("novel") == [5, 6]
    joined = join_batches([batch, rows_batch([[3]], [0], [taken], schedule=Schedule("dense"), params=SamplingParams(),
                                             stats=RolloutStats(), num_loops=2, dtype=torch.float32, pad_id=0)],
                          SamplingParams(), RolloutStats())
    assert joined.novel.tolist() == [[5, 6, 7], [5, 6, -3]]
    partial = PartialRow(segments=1)
    partial.take(batch, 0, 3)
    plain = partial.plain()
    assert plain["tokens"]["novel"].tolist() == [5, 6, 7]
    assert {k: v.tobytes() for k, v in PartialRow.from_plain(plain).values.items()} == \
        {k: v.tobytes() for k, v in partial.values.items()}
    assert partial.nbytes() == 3 * rows_module.token_bytes(2)


def test_a_row_taken_from_its_batch_is_the_row():
    """Rows into a batch and back, field by field: every value kept bit for bit (NaN gates, -inf
    log-probs and signed zeros included); the exit log-prob an engine left unknown is the one its
    gates give, and a recorded one is kept."""
    row = Row()
    row.add(4, 2, float("-inf"), -0.0)
    row.force([9], versions=3)
    row.extend([6, 7], [1, 2], [-1.5, -2.5], [-0.75, -1.25], [12, -1])
    row.add_gates(torch.tensor([[0.25, NAN, 0.5, 1.0], [0.75, NAN, 0.125, 0.0]]))
    recorded = Row()
    recorded.add_env([1, 2], 2)
    batch = rows_batch([[1]], [0, 0], [row, recorded], schedule=Schedule("dense"), params=SamplingParams(),
                       stats=RolloutStats(), num_loops=2, dtype=torch.float32, pad_id=0)
    assert batch.versions.tolist() == [[-1, 3, -1, -1], [-1, -1, -1, -1]]
    back = Row()
    back.take(batch, 0, len(row))
    for name, values in row.values.items():
        if name != "exit_logprobs":
            assert back.values[name].tobytes() == values.tobytes(), name
    derived = back.column("exit_logprobs")
    assert derived[1] == 0.0 and all(v == v for v in derived)  # forced: 0; sampled: computed, not NaN
    assert recorded.column("exit_logprobs") == [0.0, 0.0] and batch.env_mask[1, :2].all()
    assert batch.gate_probs[:, 1].isnan().all()
    loaded = Row().load(row.plain())  # the checkpoint form and back
    assert {k: v.tobytes() for k, v in loaded.values.items()} == {k: v.tobytes() for k, v in row.values.items()}
