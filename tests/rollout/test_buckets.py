"""Bucketed passes (rltt.rollout.buckets): padded to static item counts — the shapes a CUDA graph
captures — they compute, on CPU, what the unpadded passes compute, bit for bit: tokens, exits,
log-probs, gates, kept sets, pass records, the executor's KV cache, carries and gates; a replay of a
bucketed rollout is bitwise; the learner's ratio is exactly 1 at the rollout weights."""

import itertools

import pytest
import torch

from rltt.errors import RlttError
from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs
from rltt.rollout.attention import PassSetup
from rltt.rollout.buckets import (BUCKETS, PaddingCheck, PassBuckets, _checked_counts, bucket_of,
                                  resolve_cuda_graphs, tail_free)
from rltt.rollout.executor import PassExecutor

from .helpers import fields_equal as _equal, prompts, rollout_fields as _fields, tiny_model


def test_the_bucket_table():
    assert list(BUCKETS) == sorted(set(BUCKETS)) and BUCKETS[:3] == (1, 2, 4)
    for n in range(0, BUCKETS[-1] + 40):
        size = bucket_of(n)
        if n < 1 or n > BUCKETS[-1]:
            assert size is None  # beyond the table: unbucketed
        else:
            assert size in BUCKETS and size >= n and all(b < n for b in BUCKETS if b < size)
    # the CPU check pads every count a pass may be padded at (3 included), never a count that is a bucket
    checked = _checked_counts(BUCKETS)
    assert checked[0] == 3 and not set(checked) & set(BUCKETS)
    assert set(range(1, 129)) - set(checked) == {b for b in BUCKETS if b <= 128}


def _compare(model, sizes, params, chunk_rows=None):
    """The unbucketed and the bucketed engine on the same model and prompts: every recorded field
    equal; returns the bucketed batch and the passes it padded."""
    want = NativeEngine(model, chunk_rows=chunk_rows).generate(prompts(sizes, seed=2), params)
    engine = NativeEngine(model, chunk_rows=chunk_rows, buckets=True)
    got = engine.generate(prompts(sizes, seed=2), params)
    assert _equal(_fields(got), _fields(want))
    return got, engine.buckets


POLICIES = ["sample", "threshold:0.6", "final", "fixed:2"]
DTYPES = [torch.float32, torch.bfloat16]
# (prompt lengths, n): passes of 1-2 items (buckets of their own), 3 (padded to 4 where the CPU check allows),
# 4 and more (padded), prefill and pending entries
SHAPES = [([3, 6], 2), ([2, 5, 7], 4), ([4, 1, 9, 2, 6], 1), ([5], 6), ([3, 8, 2, 4], 5)]
CASES = list(itertools.product(DTYPES, ["dense", "deferred"], POLICIES))


@pytest.mark.parametrize("dtype,schedule,policy", CASES)
def test_bucketed_rollouts_equal_the_unbucketed_bit_for_bit(dtype, schedule, policy):
    shape = SHAPES[CASES.index((dtype, schedule, policy)) % len(SHAPES)]
    model = tiny_model(dtype=dtype)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=6, n=shape[1], seed=5, exit_policy=policy,
                            schedule=schedule)
    _, buckets = _compare(model, shape[0], params)
    assert buckets.eager > 0 and len(buckets.buckets) >= 1  # passes were padded (fails without the buckets)


@pytest.mark.parametrize("case", [
    dict(dtype=torch.float32, model=dict(lora_rank=2), sampling=dict(temperature=1.0)),  # step-wise LoRA: int steps
    dict(dtype=torch.bfloat16, model=dict(injection="scalar", qk_norm=True, attention_bias=True),
         sampling=dict(temperature=0.7, top_k=9)),
    dict(dtype=torch.float32, model=dict(norm_placement="ouro", num_loops=3), sampling=dict(temperature=0)),
    dict(dtype=torch.bfloat16, model=dict(num_key_value_heads=4, carry_normed_state=True),
         sampling=dict(temperature=1.0, stop_token_ids=[3, 7, 11])),
    dict(dtype=torch.float32, model=dict(), sampling=dict(temperature=1.0, stop_token_ids=[5, 9]), chunk_rows=6),
])
@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_model_variants_stop_tokens_and_chunks(case, schedule):
    model = tiny_model(dtype=case["dtype"], **case["model"])
    params = SamplingParams(max_new_tokens=7, n=3, seed=9, exit_policy="sample", schedule=schedule, **case["sampling"])
    _, buckets = _compare(model, [4, 7, 2, 5], params, chunk_rows=case.get("chunk_rows"))
    assert buckets.eager > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loops", [1, 2, 4])
def test_a_sweep_of_batch_sizes_and_loops(dtype, loops):
    """Passes of 1 up to 46-54 items (prefill, dense and deferred decode; at T = 2 every count from 1 to
    18), each bucketed or, where the CPU check rules its count out, unpadded."""
    model = tiny_model(dtype=dtype, num_loops=loops)
    seen = set()
    for rows, schedule, policy in itertools.product((4, 5, 7, 11, 16), ("dense", "deferred"), ("sample", "final")):
        params = SamplingParams(temperature=1.0, max_new_tokens=5, n=1, seed=rows, exit_policy=policy,
                                schedule=schedule)
        batch, buckets = _compare(model, [1 + (3 * r) % 5 for r in range(rows)], params)
        seen |= {int(p.entries()) for p in batch.schedule.passes if buckets.size_of(int(p.entries())) is not None}
    assert any(n not in BUCKETS for n in seen)  # padded passes among them


@pytest.mark.parametrize("dtype,schedule", [(torch.float32, "deferred"), (torch.bfloat16, "dense"),
                                            (torch.bfloat16, "deferred")])
def test_replay_of_a_bucketed_rollout_is_bitwise(dtype, schedule):
    model = tiny_model(dtype=dtype)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=6, n=4, seed=4, exit_policy="sample",
                            schedule=schedule)
    engine = NativeEngine(model, chunk_rows=12, buckets=True)
    batch = engine.generate(prompts([3, 5, 2], seed=1), params)
    replays = engine.buckets.eager
    replayed = replay_logprobs(model, batch, engine.buckets)  # the engine's buckets: bucketed passes
    assert engine.buckets.eager > replays
    assert torch.equal(replayed.logprobs, batch.logprobs)
    assert torch.equal(replayed.tempered_logprobs, batch.tempered_logprobs)
    assert torch.equal(replayed.exit_logprobs, batch.exit_logprobs)
    eager = engine.buckets.eager  # and the unbucketed passes replay it bit for bit too (CPU)
    assert torch.equal(replay_logprobs(model, batch).logprobs, batch.logprobs)
    assert engine.buckets.eager == eager  # without the buckets given, a replay does not touch them


@pytest.mark.parametrize("dtype,schedule", [(torch.float32, "dense"), (torch.bfloat16, "deferred")])
def test_the_learner_ratio_is_exactly_one_after_a_bucketed_rollout(dtype, schedule):
    import copy

    from rltt.learner import AlgorithmConfig, Learner, LearnerBatch, LearnerConfig

    model = tiny_model(dtype=dtype)
    params = SamplingParams(temperature=0.9, max_new_tokens=7, n=2, seed=3, exit_policy="sample", schedule=schedule)
    engine = NativeEngine(model, buckets=True)
    rollout = engine.generate(prompts([4, 6], seed=1), params)
    assert engine.buckets.eager > 0
    batch = LearnerBatch.from_rollout(rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=2, dtype="bf16" if dtype == torch.bfloat16 else "fp32")
    learner = Learner(copy.deepcopy(model).float(), cfg, AlgorithmConfig(track_kl=False), batch_size=batch.size,
                      max_len=7, rollout_dtype=dtype)
    metrics = learner.update(batch)
    assert metrics["policy/ratio_mean"] == 1.0 and metrics["policy/ratio_max"] == 1.0
    assert metrics["policy/ratio_min"] == 1.0


def test_passes_per_token_are_the_exit_steps_under_bucketing():
    """One row, deferred: each token takes exactly its t* passes (its prompt rides along in the first
    token's passes, padded), so passes per token = the mean exit step."""
    model = tiny_model()
    params = SamplingParams(temperature=1.0, max_new_tokens=9, seed=1, exit_policy="sample", schedule="deferred")
    batch, buckets = _compare(model, [7], params)
    assert buckets.eager > 0
    assert batch.stats.passes == int(batch.exit_steps[batch.completion_mask].sum())


def test_padded_items_write_nothing():
    """Executor state after the same passes with and without buckets: KV cache, carries and gates
    bit for bit (padded items write no cell), and the padded buffers' extra rows never reach it."""
    model = tiny_model()
    plans = [([0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [3, 4, 2, 5, 1], [1, 1, 1, 1, 1]),
             ([0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [3, 4, 2, 5, 1], [2, 2, 2, 2, 2]),
             ([0, 2, 1, 3, 4], [4, 3, 0, 0, 2], [4, 3, 4, 5, 2], [1, 1, 3, 3, 3])]
    states = []
    for buckets in (None, PassBuckets(model, capture=False)):
        executor = PassExecutor(model, 5, 8, PassSetup.of(buckets=buckets))
        executor.tokens.copy_(torch.randint(1, 60, (5, 8), generator=torch.Generator().manual_seed(0)))
        outs = [executor.run(*plan)[:2] for plan in plans]
        states.append([t.clone() for o in outs for t in o] + executor.cache.keys + executor.cache.values
                      + [executor.carry, executor.gates.nan_to_num(-1.0)])
        if buckets is not None:
            assert buckets.eager == len(plans) and sorted(buckets.buckets) == [16, 24]
    assert _equal(states[0], states[1])


def test_bucket_buffers_are_the_plans():
    """The static buffers a bucket allocates: the memory plan's per-bucket bytes (measured)."""
    from rltt.planning.graph_memory import bucket_buffer_bytes
    from rltt.planning.shapes import ModelShape

    for dtype in DTYPES:
        model = tiny_model(dtype=dtype)
        buckets = PassBuckets(model, capture=False)
        for size in (4, 12, 96):
            buckets.bucket(size)
        shape = ModelShape.of(model.config)
        assert buckets.nbytes() == bucket_buffer_bytes(shape, dtype.itemsize, (4, 12, 96), capture=False)
        assert bucket_buffer_bytes(shape, 2, (4,), capture=True) > bucket_buffer_bytes(shape, 2, (4,), capture=False)


def test_cuda_graphs_setting():
    assert resolve_cuda_graphs(None, "cpu") is False and resolve_cuda_graphs(False, "cpu") is False
    with pytest.raises(Exception, match="rollout.cuda_graphs.*CUDA"):
        resolve_cuda_graphs(True, "cpu")
    with pytest.raises(Exception, match="rollout.cuda_graphs"):
        NativeEngine(tiny_model(), cuda_graphs=True)
    assert NativeEngine(tiny_model()).buckets is None  # CPU default: today's passes
    with pytest.raises(RlttError, match="CUDA"):
        PassBuckets(tiny_model(), capture=True)


def test_the_recipe_key_reaches_the_engine():
    from pathlib import Path

    from rltt.errors import ConfigError
    from rltt.orchestration.engines import make_engine
    from rltt.orchestration.train_recipe import load_train_recipe

    gsm8k = Path(__file__).resolve().parents[2] / "recipes" / "gsm8k.yaml"
    recipe = load_train_recipe(gsm8k, ["model.path=quickstart", "rollout.cuda_graphs=true"])
    assert recipe.rollout.cuda_graphs is True
    with pytest.raises(ConfigError, match="recipe key 'rollout.cuda_graphs': true needs a CUDA device"):
        make_engine(recipe.rollout, tiny_model())
    default = load_train_recipe(gsm8k, ["model.path=quickstart"])
    assert default.rollout.cuda_graphs is None and make_engine(default.rollout, tiny_model()).buckets is None


# -- the capture path, on CPU: CUDA-graph semantics emulated (rltt/rollout/graph_emulation.py) --------
def _captured_engine(model, **kwargs):
    from rltt.rollout.graph_emulation import EmulatedGraphs

    engine = NativeEngine(model, **kwargs)
    engine.buckets = PassBuckets(model, capture=True, graphs=EmulatedGraphs())
    return engine


def test_the_emulator_replays_captured_addresses():
    from rltt.rollout.graph_emulation import EmulatedGraphs

    graphs, x = EmulatedGraphs(), torch.arange(4.0)
    outside = torch.ones(4)
    graph = graphs.graph()
    graphs.begin(graph)
    y = x * 2 + outside
    graphs.end(graph)
    x.copy_(torch.full((4,), 10.0))
    graph.replay()
    assert torch.equal(y, torch.full((4,), 21.0))  # the static input's new values
    stale = outside
    outside = torch.zeros(4)  # a new tensor in the Python name: the graph still reads the captured one
    graph.replay()
    assert torch.equal(y, 20.0 + stale)


@pytest.mark.parametrize("dtype,schedule,policy", [(torch.float32, "dense", "sample"),
                                                   (torch.bfloat16, "deferred", "threshold:0.6"),
                                                   (torch.float32, "deferred", "fixed:2")])
def test_captured_passes_replay_bit_for_bit(dtype, schedule, policy):
    model = tiny_model(dtype=dtype)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=6, n=3, seed=5, exit_policy=policy,
                            schedule=schedule)
    want = NativeEngine(model).generate(prompts([3, 6, 2], seed=2), params)
    engine = _captured_engine(model)
    got = engine.generate(prompts([3, 6, 2], seed=2), params)
    assert _equal(_fields(got), _fields(want))
    captured = sum(len(b.graphs) for b in engine.buckets.buckets.values())
    assert engine.buckets.replays > captured > 0 and engine.buckets.eager == 0  # replays, not eager passes
    pieces = next(iter(next(iter(engine.buckets.buckets.values())).graphs.values())).pieces
    assert len(pieces) == model.config.num_hidden_layers + 1  # cut at each attention call
    replayed = replay_logprobs(model, got, engine.buckets)
    assert torch.equal(replayed.logprobs, got.logprobs) and torch.equal(replayed.exit_logprobs, got.exit_logprobs)


@pytest.mark.parametrize("overrides", [dict(lora_rank=2), dict(injection="scalar")])
def test_each_step_kind_has_its_graph(overrides, monkeypatch):
    """The first step (z = e), later uniform steps (one graph for all, or one per step with a step-wise
    LoRA) and depth-mixed steps capture different pieces: one graph for every kind would be wrong."""
    model = tiny_model(**overrides)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=7, exit_policy="sample", schedule="deferred")
    want = NativeEngine(model).generate(prompts([3, 5], seed=2), params)
    engine = _captured_engine(model)
    assert _equal(_fields(engine.generate(prompts([3, 5], seed=2), params)), _fields(want))
    kinds = set().union(*(b.graphs for b in engine.buckets.buckets.values()))
    if "lora_rank" in overrides:  # a graph per uniform step
        assert {1, -1} < kinds and 0 not in kinds
    else:
        assert kinds == {1, 0, -1}
    monkeypatch.setattr(PassBuckets, "step", _one_kind(PassBuckets.step))
    wrong = _captured_engine(model).generate(prompts([3, 5], seed=2), params)
    assert not torch.equal(wrong.logprobs, want.logprobs)


def _one_kind(step):
    def patched(self, size, embeds, carry, step_value, cos, sin, attend):
        b = self.bucket(size)
        if b.graphs:  # every pass replays the first graph this bucket captured
            b.graphs = {k: next(iter(b.graphs.values())) for k in (1, 0, -1, *range(2, 9))}
        return step(self, size, embeds, carry, step_value, cos, sin, attend)
    return patched


def test_captured_passes_follow_weight_changes():
    """Graphs read the parameters by address: an in-place update (an optimizer step, `load_weights`)
    is seen, the fused q/k/v copies refreshed before the passes; new parameter tensors drop the graphs."""
    model = tiny_model()
    # final exits, no stop: the same passes whatever the weights, so the second call captures nothing new
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=3, seed=2, exit_policy="final", schedule="dense",
                            ignore_eos=True)
    engine = _captured_engine(model)
    engine.generate(prompts([4, 2]), params)
    made = len(engine.buckets.graphs.made)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    assert _equal(_fields(engine.generate(prompts([4, 2]), params)),
                  _fields(NativeEngine(model).generate(prompts([4, 2]), params)))
    assert len(engine.buckets.graphs.made) == made  # replayed the first call's graphs: nothing recaptured
    graphs = {id(g) for b in engine.buckets.buckets.values() for g in b.graphs.values()}
    model.load_state_dict({k: v * 0.9 for k, v in model.state_dict().items()}, assign=True)
    got = engine.generate(prompts([4, 2]), params)
    assert not graphs & {id(g) for b in engine.buckets.buckets.values() for g in b.graphs.values()}
    assert _equal(_fields(got), _fields(NativeEngine(model).generate(prompts([4, 2]), params)))


@pytest.mark.parametrize("engine,setting", [("native", None), ("native", False), ("vllm", None)])
def test_the_plan_counts_the_graphs_buckets_and_pool(engine, setting):
    from pathlib import Path

    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.planning import plan_run
    from rltt.planning.graph_memory import engine_graphs_bytes
    from rltt.planning.shapes import model_shape
    from rltt.telemetry.schema import GIB
    from tests.planning.helpers import OURO_1_4B

    overrides = ["model.path=quickstart", f"rollout.engine={engine}", "model.dtype=bf16", "learner.dtype=bf16",
                 "learner.backend=torch", "rollout.schedule=dense"]
    if setting is not None:
        overrides.append(f"rollout.cuda_graphs={str(setting).lower()}")
    recipe = load_train_recipe(Path(__file__).resolve().parents[2] / "recipes" / "gsm8k.yaml", overrides)
    expected = engine_graphs_bytes(model_shape(OURO_1_4B), 2, capture=True) if engine == "native" and setting is None \
        else 0
    assert plan_run(recipe, OURO_1_4B, 80 * GIB, device="cuda").components["engine_graphs"] == expected
    assert plan_run(recipe, OURO_1_4B, 80 * GIB, device="cpu").components["engine_graphs"] == 0
    assert engine != "native" or setting is not None or 0.1 * GIB < expected < 0.3 * GIB  # Ouro-1.4B, bf16


@pytest.mark.parametrize("schedule,policy,stops", [("dense", "sample", []), ("deferred", "threshold:0.6", [3, 8]),
                                                   ("deferred", "final", [])])
def test_bucketed_passes_add_no_sync_read_or_upload(schedule, policy, stops):
    """Host work per pass (rltt.rollout.host_work) of the bucketed passes: no operator that syncs, and the
    same device reads and host-made tensors per pass as the unbucketed passes (the buffers are filled by
    device copies)."""
    from rltt.rollout.host_work import rollout_host_work

    model = tiny_model()
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=3, seed=5, exit_policy=policy, schedule=schedule,
                            stop_token_ids=stops)
    works = {}
    for bucketed in (False, True):
        engine = NativeEngine(model, buckets=bucketed)
        _, works[bucketed] = rollout_host_work(engine, prompts([3, 7]), params)
    assert engine.buckets.eager > 0 and works[True].syncs == 0, works[True].sync_sites
    for key in ("pass_reads", "pass_made", "pass_uploads"):
        assert getattr(works[True], key) == getattr(works[False], key), key


def _counts(batch) -> list[int]:
    return [int(p.entries()) for p in batch.schedule.passes]


def _replays_bitwise(model, engine, batch) -> None:
    """`replay_logprobs` of a captured rollout: every pass replayed through the engine's buckets again,
    the rollout's log-probs bit for bit."""
    before = engine.buckets.replays
    replayed = replay_logprobs(model, batch, engine.buckets)
    assert engine.buckets.replays - before == len(batch.schedule.passes) and engine.buckets.eager == 0
    assert torch.equal(replayed.logprobs, batch.logprobs)
    assert torch.equal(replayed.tempered_logprobs, batch.tempered_logprobs)
    assert torch.equal(replayed.exit_logprobs, batch.exit_logprobs)


@pytest.mark.parametrize("dtype,schedule,policy,prompt", [(torch.float32, "dense", "sample", 8),
                                                          (torch.bfloat16, "dense", "threshold:0.6", 4),
                                                          (torch.float32, "deferred", "fixed:2", 1),
                                                          (torch.bfloat16, "deferred", "fixed:2", 8)])
def test_a_batch_1_rollout_replays_graphs_for_every_pass(dtype, schedule, policy, prompt):
    """One row: its decode passes run 1 item (deferred with exits at step 2: 1-2 items), which are buckets
    of their own, and its prompt here is a bucket's length too, so no pass is padded (nor consults the
    CPU check, whose verdicts depend on the machine): with capture (emulated) every pass
    replays graphs — none runs unbucketed or eagerly — and the rollout is the unbucketed engine's bit
    for bit on CPU, its replay bitwise."""
    model = tiny_model(dtype=dtype)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=8, seed=5, exit_policy=policy,
                            schedule=schedule)
    want = NativeEngine(model).generate(prompts([prompt], seed=2), params)
    engine = _captured_engine(model)
    got = engine.generate(prompts([prompt], seed=2), params)
    assert _equal(_fields(got), _fields(want))
    counts = _counts(got)
    assert 1 in counts and set(counts) <= set(BUCKETS)  # every pass a bucket's count: nothing padded
    assert engine.buckets.replays == len(counts) == got.stats.passes and engine.buckets.eager == 0
    _replays_bitwise(model, engine, got)


@pytest.mark.parametrize("dtype,schedule,sizes", [(torch.float32, "dense", [5]), (torch.bfloat16, "deferred", [1]),
                                                  (torch.float32, "deferred", [5]), (torch.bfloat16, "dense", [3, 6, 2])])
def test_with_the_cuda_padding_rule_every_pass_replays_graphs(dtype, schedule, sizes):
    """With CUDA no count is kept from padding (`PaddingCheck()`: the bucketed rollout need only equal its
    own bucketed replay): every pass of up to 512 items — 1 and 2 items as they are, 3 padded to 4, a
    5-item prefill to 8 — replays graphs, and the replay is bitwise. (Here on CPU the padded passes may
    differ from the unbucketed engine's bits; that is what the CPU check is for.) One row, and three rows
    whose decode passes run 3 and 2 items."""
    model = tiny_model(dtype=dtype)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=8, seed=5, exit_policy="sample",
                            schedule=schedule)
    engine = _captured_engine(model)
    engine.buckets.check = PaddingCheck(threads=torch.get_num_threads())  # what a CUDA device gets
    got = engine.generate(prompts(sizes, seed=2), params)
    counts = _counts(got)
    assert set(counts) - set(BUCKETS) and min(counts) < 4  # padded passes and passes of 1-3 items among them
    assert engine.buckets.replays == len(counts) and engine.buckets.eager == 0
    _replays_bitwise(model, engine, got)


def test_a_failed_capture_is_a_one_line_error_naming_the_switch(monkeypatch):
    from rltt.rollout.graph_emulation import EmulatedGraphs

    model = tiny_model()
    engine = _captured_engine(model)
    monkeypatch.setattr(EmulatedGraphs, "warmed", lambda self: (_ for _ in ()).throw(RuntimeError("not capturable\nx")))
    with pytest.raises(RlttError, match=r"capture of a \d+-item pass failed \(RuntimeError: not capturable x\); "
                                        r"rollout.cuda_graphs: false"):
        engine.generate(prompts([4, 5]), SamplingParams(temperature=0, max_new_tokens=2, n=2))


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_a_wider_model_where_row_counts_change_fp32_kernels(schedule):
    """At d = 256 a CPU fp32 GEMM's row values depend on the batch's row class (on one machine 1, 2-3,
    >= 4; on another, AVX-512, 1, 2-5, >= 6 up to >= 16 by the GEMM's depth): padding across a class
    boundary would change bits here. With the counts the engine measured unsafe
    (`cpu_padding_check`) left unpadded and the others padded, all are equal, and some are padded."""
    model = tiny_model(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    padded = 0
    for sizes, n in (([3, 5], 1), ([2, 6, 3], 1), ([1, 2, 3, 4, 5], 1), ([4, 4], 3)):
        params = SamplingParams(temperature=1.0, max_new_tokens=6, n=n, seed=5, exit_policy="sample",
                                schedule=schedule)
        batch, buckets = _compare(model, sizes, params)
        padded += sum(buckets.size_of(int(p.entries())) not in (None, p.entries()) for p in batch.schedule.passes)
    assert padded > 0


def test_tail_free_counts_whole_vector_loops():
    """A pass is padded only where every per-item width fills whole 128-byte vector loops at both
    sizes (an elementwise kernel's scalar tail gives other bits than its vector body), on one thread
    and in each thread's chunk once a tensor is split among threads."""
    assert tail_free(6, 8, {48}, 4, 1) and tail_free(4, 8, {16}, 4, 1)
    assert not tail_free(5, 8, {48}, 4, 1)  # 5 · 48 fp32 values: 960 bytes, a 64-byte tail
    assert not tail_free(6, 8, {48, 16}, 2, 1)  # 6 · 16 bf16 values: 192 bytes
    assert tail_free(2048, 2048, {2048}, 2, 1) and tail_free(100, 128, {2048}, 2, 2)
    # 1025 · 32 fp32 values: whole loops on one thread, but split in two chunks of 16,400 values
    assert tail_free(1025, 1025, {32}, 4, 1) and not tail_free(1025, 1025, {32}, 4, 2)
