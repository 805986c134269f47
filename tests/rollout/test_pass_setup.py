"""How an engine's passes run is resolved once: `rollout.attention` into its `AttentionSpec` when
the engine is made (a replay resolves the name its record holds, once per call), and the engine's
CUDA-graph buckets travel with it (`PassSetup`) — no table keyed by the model decides which passes
an executor runs."""

import torch

from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs
from rltt.rollout import attention as attention_module

from .helpers import prompts, tiny_model


def test_the_attention_is_resolved_once_per_engine_and_once_per_replay(monkeypatch):
    calls = []
    real = attention_module.resolve_attention

    def counted(name, device, key="rollout.attention"):
        calls.append(name)
        return real(name, device, key)

    monkeypatch.setattr(attention_module, "resolve_attention", counted)
    model = tiny_model()
    engine = NativeEngine(model, chunk_rows=2, continuous=False)
    assert calls == ["sdpa"] and engine.setup.attention.name == engine.attention == "sdpa"
    params = SamplingParams(max_new_tokens=4, n=2, seed=3, exit_policy="sample", schedule="deferred")
    batch = engine.generate(prompts([3, 4, 2]), params)  # three chunks, three executors
    assert calls == ["sdpa"] and batch.schedule.chunks is not None and len(batch.schedule.chunks) == 3
    assert torch.equal(replay_logprobs(model, batch).logprobs, batch.logprobs)
    assert calls == ["sdpa", "sdpa"]  # the record's name, once for the whole replay


def test_two_engines_on_one_model_keep_their_own_passes():
    """A bucketed and an unbucketed engine sharing a model: each runs its own passes, whichever sampled
    last (a model-keyed table let the last engine decide for every executor)."""
    model = tiny_model()
    params = SamplingParams(max_new_tokens=4, n=2, seed=3, exit_policy="sample", schedule="deferred")
    bucketed, plain = NativeEngine(model, buckets=True), NativeEngine(model, buckets=False)
    assert plain.buckets is None and bucketed.buckets is not None
    bucketed.generate(prompts([3, 4]), params)
    eager = bucketed.buckets.eager
    assert eager > 0
    plain.generate(prompts([3, 4]), params)
    assert bucketed.buckets.eager == eager  # the plain engine's passes never went through the buckets
    bucketed.generate(prompts([3, 4]), params)
    assert bucketed.buckets.eager > eager
