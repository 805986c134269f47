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
