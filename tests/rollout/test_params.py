"""Clear one-line errors for bad sampling parameters and prompts."""

import pytest

from rltt.errors import RlttError
from rltt.rollout import NativeEngine, SamplingParams

from .helpers import VOCAB, tiny_model


@pytest.fixture(scope="module")
def engine():
    return NativeEngine(tiny_model(max_position_embeddings=16))


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5),
    ("max_new_tokens", 0), ("max_new_tokens", True), ("n", 0), ("seed", 1.5),
    ("schedule", "lazy"), ("stop_token_ids", [VOCAB]), ("stop_token_ids", "abc"),
    ("stop_strings", "###"), ("stop_strings", [""]), ("exit_policy", "fixed:9"), ("exit_policy", "median"),
])
def test_invalid_parameter_names_the_field(engine, field, value):
    with pytest.raises(RlttError) as err:
        engine.generate([[1, 2]], SamplingParams(**{field: value}))
    message = str(err.value)
    assert field in message and "\n" not in message


def test_stop_strings_need_a_decoder(engine):
    with pytest.raises(RlttError, match="decoder"):
        engine.generate([[1, 2]], SamplingParams(stop_strings=["x"]))


@pytest.mark.parametrize("prompts,match", [
    ([[1, 2], []], r"prompts\[1\] is empty"),
    ([], "non-empty list"),
    ([[1, VOCAB]], r"prompts\[0\].*outside"),
    ([list(range(1, 18))], "max_position_embeddings=16"),
])
def test_bad_prompts(engine, prompts, match):
    with pytest.raises(RlttError, match=match):
        engine.generate(prompts, SamplingParams(max_new_tokens=2))


def test_prompt_at_the_position_limit_generates_then_stops_with_length(engine):
    batch = engine.generate([list(range(1, 16))], SamplingParams(max_new_tokens=10, seed=0))
    # positions 0..15 exist: the prompt uses 0..14, one more token is fed, so 2 are sampled
    assert batch.completion_lengths.tolist() == [2] and batch.finish_reasons == ["length"]


def test_engine_needs_a_looped_model():
    with pytest.raises(RlttError, match="LoopedForCausalLM"):
        NativeEngine(object())
