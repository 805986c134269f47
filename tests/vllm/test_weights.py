"""In-place weight updates of a live VllmEngine: the next generate equals a fresh engine (and the native
engine) on the new weights and differs from the old; versions and names are checked."""

from __future__ import annotations

import pytest
import torch

from rltt.errors import RlttError
from rltt.rollout import NativeEngine, SamplingParams
from tests.vllm.helpers import ENGINE_OPTIONS, PROMPTS, looped_model, needs_vllm, perturbed

pytestmark = [pytest.mark.heavy, pytest.mark.slow, needs_vllm]

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, exit_policy="threshold:0.5", schedule="dense", seed=0)


def _new_model():
    old_model = looped_model(num_loops=2, seed=0, injection="scalar")
    new_model = looped_model(num_loops=2, seed=0, injection="scalar")
    new_model.load_state_dict(perturbed(old_model, scale=0.2))
    return new_model


@pytest.fixture(scope="module")
def fresh_on_new_weights():
    """Greedy rows of a fresh engine built on the new weights, made (and shut down) before the
    module's engine starts: one in-process vLLM engine at a time, as in a training run."""
    from rltt.vllm.vllm_engine import VllmEngine

    fresh = VllmEngine(_new_model(), **ENGINE_OPTIONS)
    try:
        return fresh.generate(PROMPTS, GREEDY)
    finally:
        fresh.close()


@pytest.fixture(scope="module")
def engine(fresh_on_new_weights):
    from rltt.vllm.vllm_engine import VllmEngine

    built = VllmEngine(looped_model(num_loops=2, seed=0, injection="scalar", tie_word_embeddings=False),
                       **ENGINE_OPTIONS)
    yield built
    built.close()


def test_load_weights_in_place_equals_fresh_engine(engine, fresh_on_new_weights):
    old_model = looped_model(num_loops=2, seed=0, injection="scalar")
    before = engine.generate(PROMPTS, GREEDY)
    assert engine.weights_version == 0
    new_model = _new_model()
    new_state = new_model.state_dict()
    engine.load_weights(1, new_state)
    assert engine.weights_version == 1
    after = engine.generate(PROMPTS, GREEDY)
    assert not torch.equal(after.completion_ids, before.completion_ids)
    native = NativeEngine(new_model).generate(PROMPTS, GREEDY)
    assert torch.equal(after.completion_ids, native.completion_ids)
    assert torch.equal(after.exit_steps, native.exit_steps)
    again = fresh_on_new_weights
    assert torch.equal(after.completion_ids, again.completion_ids)
    assert torch.equal(after.exit_steps, again.exit_steps)
    assert torch.allclose(after.logprobs, again.logprobs, atol=1e-5)
    # a second swap (back to the old weights) works too: vLLM's CPU weight repacking is redone each time
    engine.load_weights(2, old_model.state_dict())
    assert torch.equal(engine.generate(PROMPTS, GREEDY).completion_ids, before.completion_ids)


def test_load_weights_checks_version_and_names(engine):
    state = looped_model(num_loops=2, seed=0, injection="scalar").state_dict()
    served = engine.weights_version
    with pytest.raises(RlttError, match="version must be an int >="):
        engine.load_weights(served - 1, state)
    bad = dict(state)
    bad.pop("model.exit_gate.weight")
    with pytest.raises(RlttError, match="missing \\['model.exit_gate.weight'\\]"):
        engine.load_weights(served + 1, bad)
    with pytest.raises(RlttError, match="unexpected \\['extra'\\]"):
        engine.load_weights(served + 1, dict(state, extra=torch.zeros(1)))
    assert engine.weights_version == served


def test_head_dim_below_64_fails_before_vllm_starts():
    from rltt.vllm.vllm_engine import VllmEngine

    small = looped_model(num_loops=2, hidden_size=64, num_attention_heads=2, head_dim=32)
    with pytest.raises(RlttError, match="head_dim >= 64") as err:
        VllmEngine(small, **ENGINE_OPTIONS)
    assert "\n" not in str(err.value)


def _base_model():
    return looped_model(num_loops=2, seed=0, injection="scalar", tie_word_embeddings=False)


def test_reloaded_gate_and_head_are_the_ones_later_steps_use(engine):
    """Weights reloaded in place reach the parts of the model vLLM runs: a changed exit gate
    changes the exits, a changed LM head the tokens — as on the native engine with those weights
    (this engine is eager; tests/vllm/test_compiled.py runs the same on a torch.compiled one)."""
    check_reload_reaches_gate_and_head(engine)


def check_reload_reaches_gate_and_head(engine):
    base = _base_model()
    engine.load_weights(engine.weights_version + 1, base.state_dict())
    before = engine.generate(PROMPTS, GREEDY)
    assert torch.equal(before.exit_steps, NativeEngine(base).generate(PROMPTS, GREEDY).exit_steps)
    for name, scale in (("model.exit_gate.weight", 3.0), ("lm_head.weight", 0.5)):
        changed = _base_model()
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            param = dict(changed.named_parameters())[name]
            param.add_(scale * torch.randn(param.shape, generator=g))
        engine.load_weights(engine.weights_version + 1, changed.state_dict())
        after, native = engine.generate(PROMPTS, GREEDY), NativeEngine(changed).generate(PROMPTS, GREEDY)
        assert torch.equal(after.completion_ids, native.completion_ids)
        assert torch.equal(after.exit_steps, native.exit_steps)
        if name == "model.exit_gate.weight":
            assert not torch.equal(after.exit_steps, before.exit_steps)
        else:
            assert not torch.equal(after.completion_ids, before.completion_ids)
    engine.load_weights(engine.weights_version + 1, base.state_dict())
    assert torch.equal(engine.generate(PROMPTS, GREEDY).completion_ids, before.completion_ids)


def test_sleep_frees_the_engine_between_rollouts_and_wakes_with_the_learners_weights(engine, monkeypatch):
    """Sleeping, as calls to vLLM's ``LLM.sleep`` / ``wake_up`` (vLLM cannot sleep on CPU: off by
    default here, and the calls are recorded rather than made)."""
    calls = []
    monkeypatch.setattr(engine.llm, "sleep", lambda level=1, **kw: calls.append(("sleep", level)))
    monkeypatch.setattr(engine.llm, "wake_up", lambda tags=None: calls.append(("wake_up", tags)) or True)
    rpc = engine.llm.collective_rpc

    def recorded_rpc(method, *args, **kwargs):
        calls.append(("rpc", method))
        return rpc(method, *args, **kwargs)

    monkeypatch.setattr(engine.llm, "collective_rpc", recorded_rpc)
    assert engine.sleeps is False  # the default on CPU
    engine.generate(PROMPTS[:1], GREEDY)
    engine.sleep()
    engine.wake()
    assert [c for c in calls if c[0] != "rpc"] == []  # a no-op on CPU

    monkeypatch.setattr(engine, "sleeps", True)  # as with CUDA
    monkeypatch.setattr(engine, "_asleep", False)
    calls.clear()
    engine.generate(PROMPTS[:1], GREEDY)
    assert calls[-1] == ("sleep", 1)  # asleep for the learner's update
    calls.clear()
    new_model = _new_model()
    engine.load_weights(engine.weights_version + 1, new_model.state_dict())
    assert calls[:2] == [("wake_up", None), ("rpc", "rltt_reload")]  # awake before the weights are copied in
    calls.clear()
    after = engine.generate(PROMPTS, GREEDY)
    assert ("wake_up", None) not in calls and calls[-1] == ("sleep", 1)  # already awake; asleep after
    native = NativeEngine(new_model).generate(PROMPTS, GREEDY)
    assert torch.equal(after.completion_ids, native.completion_ids)  # the weights served are the learner's
    assert torch.equal(after.exit_steps, native.exit_steps)
    calls.clear()
    engine.generate(PROMPTS[:1], GREEDY)
    assert calls[0] == ("wake_up", None) and calls[-1] == ("sleep", 1)  # woken for the rollout, asleep after
