"""``rollout.attention: triton`` with CUDA graphs: a bucketed pass captured WHOLE — every layer's key/value
writes and slot attention inside one graph (`rltt.rollout.buckets.PassBuckets._whole`,
`rltt.rollout.kv_cache.StaticSlotAttend`) — on CPU, with CUDA-graph semantics emulated
(`rltt.rollout.graph_emulation`) and the kernels under Triton's interpreter (slow: tiny model, few tokens).

Pinned here: one graph per (bucket, step kind) capture; captures made once and replayed across passes,
rollouts and replays (each with its own KV cache, reached through the bucket's cache table); padded
items inert (no KV cell outside the real items' writes changes); the captured rollout equal bit for bit
to the eager bucketed Triton rollout, and its replay bitwise.
"""

from __future__ import annotations

import pytest
import torch

from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs
from rltt.rollout.attention import PassSetup
from rltt.rollout.buckets import WHOLE, PassBuckets
from rltt.rollout.executor import PassExecutor

from .helpers import fields_equal as _equal, prompts, rollout_fields as _fields, tiny_model


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _captured_engine(model):
    from rltt.rollout.graph_emulation import EmulatedGraphs

    engine = NativeEngine(model, attention="triton")
    engine.buckets = PassBuckets(model, capture=True, graphs=EmulatedGraphs())
    return engine


@pytest.mark.parametrize("dtype,schedule", [(torch.float32, "dense"), (torch.bfloat16, "deferred")])
def test_a_captured_triton_pass_is_one_graph_equal_to_the_eager_bucketed_pass(interpreter, dtype, schedule):
    model = tiny_model(dtype=dtype)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=4, n=3, seed=5, exit_policy="threshold:0.6",
                            schedule=schedule)
    want = NativeEngine(model, attention="triton", buckets=True).generate(prompts([4, 2], seed=2), params)
    engine = _captured_engine(model)
    got = engine.generate(prompts([4, 2], seed=2), params)
    assert _equal(_fields(got), _fields(want))
    buckets = engine.buckets
    captured = [c for b in buckets.buckets.values() for c in b.graphs.values()]
    assert captured and all(key[0] == WHOLE for b in buckets.buckets.values() for key in b.graphs)
    assert all(len(c.pieces) == 1 for c in captured)  # the whole pass, attention included: one graph
    assert len(buckets.graphs.made) == buckets.captures == len(captured)
    assert buckets.replays > buckets.captures and buckets.eager == 0
    replayed = replay_logprobs(model, got, buckets)  # the engine's buckets: the same graphs, a new cache
    assert torch.equal(replayed.logprobs, got.logprobs) and torch.equal(replayed.exit_logprobs, got.exit_logprobs)
    assert len(buckets.graphs.made) == buckets.captures  # the replay captured nothing


def test_captures_are_replayed_across_rollouts_and_caches(interpreter):
    """A second rollout (its own KV cache, other rows) replays the first one's graphs: the cache is reached
    through the table the host copies in, not through addresses baked in at capture."""
    model = tiny_model()
    params = SamplingParams(temperature=1.0, max_new_tokens=3, n=2, seed=3, exit_policy="final", schedule="dense",
                            ignore_eos=True)
    engine = _captured_engine(model)
    engine.generate(prompts([3, 5], seed=1), params)
    made = len(engine.buckets.graphs.made)
    replays = engine.buckets.replays
    got = engine.generate(prompts([3, 5], seed=4), params)  # the same pass shapes, another cache and tokens
    assert len(engine.buckets.graphs.made) == made and engine.buckets.replays > replays
    want = NativeEngine(model, attention="triton", buckets=True).generate(prompts([3, 5], seed=4), params)
    assert _equal(_fields(got), _fields(want))


def _padded_count(buckets: PassBuckets, lo: int, hi: int) -> tuple[int, int]:
    for n in range(lo, hi):
        size = buckets.size_of(n)
        if size is not None and size > n:
            return n, size
    pytest.skip(f"no count in {lo}..{hi - 1} is padded on this CPU")


def test_padded_items_write_nothing(interpreter):
    """A padded pass after a larger one in the same bucket (its stale slots and positions left in the
    bucket's inputs past the real items): the KV cache changes only at the real items' write cells,
    and its cache and outputs equal the eager bucketed pass's bit for bit."""
    from rltt.rollout.graph_emulation import EmulatedGraphs

    model = tiny_model()
    cfg = model.config
    rows, max_len = 8, 12
    runs = {}
    for capture in (False, True):
        buckets = PassBuckets(model, capture=capture, graphs=EmulatedGraphs() if capture else None)
        ex = PassExecutor(model, rows, max_len, PassSetup.of("triton", "cpu", buckets))
        gen = torch.Generator().manual_seed(0)
        for t in ex.cache.keys + ex.cache.values:  # every cell non-zero and distinct
            t.copy_(torch.randn(t.shape, generator=gen))
        ex.tokens.copy_(torch.randint(1, cfg.vocab_size, ex.tokens.shape, generator=gen))
        small, size = _padded_count(buckets, 2, rows)
        big = size if size <= rows else rows
        # a larger pass first (fills the bucket's inputs past ``small``), then the padded one at other cells
        ex.run(list(range(big)), [3] * big, [3] * big, [1] * big)
        before = [t.clone() for t in ex.cache.keys + ex.cache.values]
        h, gates, _ = ex.run(list(range(small)), [5] * small, [5] * small, [2] * small)
        after = ex.cache.keys + ex.cache.values
        written = torch.zeros(before[0].shape, dtype=torch.bool)
        written[1, :small, :, 5] = True  # step 2, the real rows, position 5: what the real items write
        for old, new in zip(before, after):
            assert torch.equal(old[~written], new[~written])  # nothing else changed
            assert not torch.equal(old[written], new[written])
        runs[capture] = (h.clone(), gates.clone(), [t.clone() for t in after], buckets)
    (h0, g0, c0, eager), (h1, g1, c1, captured) = runs[False], runs[True]
    assert torch.equal(h0, h1) and torch.equal(g0, g1) and all(torch.equal(a, b) for a, b in zip(c0, c1))
    assert captured.captures == 2 and captured.replays == 2 and captured.eager == 0
    # the buffers the buckets made (the captured pass's `SlotInputs` included): the memory plan's bytes
    from rltt.planning.graph_memory import bucket_buffer_bytes
    from rltt.planning.shapes import ModelShape

    shape = ModelShape.of(cfg)
    assert eager.nbytes() == bucket_buffer_bytes(shape, 4, eager.buckets, capture=False)
    assert captured.nbytes() == bucket_buffer_bytes(shape, 4, captured.buckets, capture=True, attention="triton")


def test_the_plan_counts_the_captured_inputs():
    from pathlib import Path

    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.planning import plan_run
    from rltt.planning.graph_memory import CAPTURED_INPUTS, engine_graphs_bytes
    from rltt.planning.shapes import model_shape
    from rltt.rollout.buckets import BUCKETS
    from rltt.telemetry.schema import GIB
    from tests.planning.helpers import OURO_1_4B

    overrides = ["model.path=quickstart", "rollout.engine=native", "model.dtype=bf16", "learner.dtype=bf16",
                 "learner.backend=torch", "rollout.schedule=dense"]
    gsm8k = Path(__file__).resolve().parents[2] / "recipes" / "gsm8k.yaml"
    shape = model_shape(OURO_1_4B)
    planned = {}
    for attention in ("sdpa", "triton"):
        recipe = load_train_recipe(gsm8k, overrides + [f"rollout.attention={attention}"])
        planned[attention] = plan_run(recipe, OURO_1_4B, 80 * GIB, device="cuda").components["engine_graphs"]
        assert planned[attention] == engine_graphs_bytes(shape, 2, capture=True, attention=attention)
    assert planned["triton"] - planned["sdpa"] == sum(CAPTURED_INPUTS["triton"](shape, s) for s in BUCKETS) > 0


def _host_operators(engine, params) -> tuple[float, int]:
    """Operators the host would dispatch with real graphs in one call (`rltt.rollout.host_work`, counted
    after a first call that captured): the profile's less those the emulated replays issued, plus one
    launch per replayed graph (as bench/rollout.py --host-work counts them); and the call's passes."""
    from rltt.rollout.host_work import rollout_host_work

    engine.generate(prompts([4, 5]), params)
    graphs = engine.buckets.graphs
    made, dispatched, launches = len(graphs.made), graphs.dispatched, graphs.launches
    _, work = rollout_host_work(engine, prompts([4, 5]), params, warmup=False)
    assert len(graphs.made) == made and work.syncs == 0  # nothing captured in the counted call
    return work.operators - (graphs.dispatched - dispatched) + (graphs.launches - launches), work.passes


def test_a_captured_triton_pass_leaves_host_work_independent_of_the_layers(interpreter):
    """Counted on CPU with the capture emulated, per decode pass (one more token's passes, so a call's
    per-layer setup cancels): with the Triton attention a replayed pass dispatches the same operators
    whatever the layer count (the copies into the bucket, one graph launch, the gate and sampling);
    with sdpa each layer adds its eager attention and a piece's launch."""
    from rltt.rollout.graph_emulation import EmulatedGraphs

    per_pass = {}
    for layers in (1, 3):
        model = tiny_model(num_hidden_layers=layers)
        for attention in ("sdpa", "triton"):
            engine = NativeEngine(model, attention=attention)
            engine.buckets = PassBuckets(model, capture=True, graphs=EmulatedGraphs())
            counts = []
            for tokens in (2, 3):  # every token runs every step: the same passes whatever the model
                # 4 rows: decode passes of 4 items, a bucket in any table (never padded: bucketed on any CPU)
                params = SamplingParams(temperature=1.0, max_new_tokens=tokens, n=2, seed=5, exit_policy="final",
                                        schedule="dense", ignore_eos=True)
                counts.append(_host_operators(engine, params))
            (ops_a, passes_a), (ops_b, passes_b) = counts
            per_pass[attention, layers] = (ops_b - ops_a) / (passes_b - passes_a)
    assert per_pass["triton", 1] == per_pass["triton", 3]
    assert per_pass["sdpa", 1] < per_pass["sdpa", 3]
    assert per_pass["triton", 3] < per_pass["sdpa", 3]
