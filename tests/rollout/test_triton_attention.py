"""``rollout.attention: triton``: the native engine's passes with one Triton launch per layer over the
cache slots read in place (`rltt.kernels.slot_attention`), on CPU under Triton's interpreter (slow:
every kernel program runs in numpy, so the rollouts here are a few tokens of a tiny model).

- a rollout records its attention implementation and replays with it bit for bit (dense, deferred;
  fp32, bf16), bucketed or not;
- its tokens and log-probs agree with the default SDPA attention within tolerance, not bitwise;
- the recipe key reaches the engine; triton without a usable Triton is a one-line recipe error.
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rltt.errors import ConfigError
from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs
from rltt.rollout.rollout_batch import Schedule, join_schedules

from .helpers import prompts, tiny_model

GSM8K = Path(__file__).resolve().parents[2] / "recipes" / "gsm8k.yaml"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _params(schedule: str, **kw) -> SamplingParams:
    return SamplingParams(**{**dict(temperature=0.9, top_p=0.95, max_new_tokens=4, n=2, seed=11,
                                    exit_policy="threshold:0.6", schedule=schedule), **kw})


@pytest.mark.parametrize("dtype,schedule", [(torch.float32, "dense"), (torch.float32, "deferred"),
                                            (torch.bfloat16, "deferred")])
def test_replay_is_bitwise_and_sdpa_agrees_within_tolerance(interpreter, dtype, schedule):
    model = tiny_model(dtype=dtype)
    params = _params(schedule)
    batch = NativeEngine(model, attention="triton").generate(prompts([5, 3], seed=2), params)
    assert batch.schedule.attention == "triton"
    replay = replay_logprobs(model, batch)  # follows the record: triton
    assert torch.equal(replay.logprobs, batch.logprobs)
    assert torch.equal(replay.tempered_logprobs, batch.tempered_logprobs)
    assert torch.equal(replay.exit_logprobs, batch.exit_logprobs)

    sdpa = NativeEngine(model).generate(prompts([5, 3], seed=2), params)
    assert sdpa.schedule.attention == "sdpa"
    # the same draws over values that differ only in rounding: these tiny rollouts sample the same tokens
    assert torch.equal(sdpa.completion_ids, batch.completion_ids) and torch.equal(sdpa.exit_steps, batch.exit_steps)
    torch.testing.assert_close(sdpa.logprobs, batch.logprobs, **TOL[dtype])
    # the SDPA record replayed with the Triton attention: the same passes, values within tolerance
    crossed = replay_logprobs(model, replace(batch, schedule=replace(sdpa.schedule, attention="triton")))
    torch.testing.assert_close(crossed.logprobs, sdpa.logprobs, **TOL[dtype])


def test_bucketed_passes_give_the_same_bits(interpreter):
    """Padded to bucket sizes (eagerly, on CPU) the Triton passes compute every real item's values bit for
    bit: the kernel's value for an item does not depend on the other items of its launch."""
    model = tiny_model()
    params = _params("deferred", exit_policy="sample", n=3)
    plain = NativeEngine(model, attention="triton", buckets=False).generate(prompts([4, 2], seed=5), params)
    bucketed = NativeEngine(model, attention="triton", buckets=True).generate(prompts([4, 2], seed=5), params)
    assert torch.equal(plain.completion_ids, bucketed.completion_ids)
    assert torch.equal(plain.logprobs, bucketed.logprobs)
    # NaN: entries not computed
    torch.testing.assert_close(plain.gate_probs, bucketed.gate_probs, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(replay_logprobs(model, bucketed).logprobs, bucketed.logprobs)  # unbucketed passes, same bits


def test_the_record_carries_the_attention():
    record = Schedule("deferred", [], replayable=True, attention="triton")
    assert pickle.loads(pickle.dumps(record)).attention == "triton"
    old = Schedule("dense", [], replayable=True)
    state = old.__getstate__()
    del state["attention"]  # a record pickled before the field existed ran SDPA
    restored = object.__new__(Schedule)
    restored.__setstate__(state)
    assert restored.attention == "sdpa"
    assert join_schedules([record, replace(record)], [1, 1]).attention == "triton"
    with pytest.raises(ValueError, match="attention"):
        join_schedules([record, old], [1, 1])


def test_recipe_key_and_errors(monkeypatch):
    from rltt.kernels import dispatch
    from rltt.orchestration.engines import make_engine
    from rltt.orchestration.train_recipe import load_train_recipe

    default = load_train_recipe(GSM8K, ["model.path=quickstart"])
    assert default.rollout.attention == "sdpa" and make_engine(default.rollout, tiny_model()).attention == "sdpa"
    recipe = load_train_recipe(GSM8K, ["model.path=quickstart", "rollout.attention=triton"])
    assert recipe.rollout.attention == "triton"
    with pytest.raises(ConfigError, match="rollout.attention"):
        load_train_recipe(GSM8K, ["model.path=quickstart", "rollout.attention=flash"])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="recipe key 'rollout.attention': triton needs a CUDA device"):
        make_engine(recipe.rollout, tiny_model())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dispatch, "triton_installed", lambda: False)
    with pytest.raises(ConfigError, match="recipe key 'rollout.attention': triton needs the triton package"):
        NativeEngine(tiny_model(), attention="triton")
    # a Triton rollout cannot be replayed without Triton (another attention would round differently)
    batch = NativeEngine(tiny_model()).generate(prompts([3]), _params("dense", max_new_tokens=1, n=1))
    with pytest.raises(ConfigError, match="triton"):
        replay_logprobs(tiny_model(), replace(batch, schedule=replace(batch.schedule, attention="triton")))


def test_a_continued_episode_records_and_replays_the_attention(interpreter):
    """Multi-turn rows continued on the chunk's executor (`rltt.rollout.continuation`) run the engine's
    attention, and the episode's record replays bitwise with it."""
    from rltt.orchestration.episodes import run_episodes
    from tests.environments.helpers import ScriptedEnv, decode, encode

    model = tiny_model()
    params = _params("deferred", temperature=1.0, max_new_tokens=6, prompt_seeds=[5, 17, 23],
                     stop_token_ids=[5, 6, 7, 8, 10], exit_policy="sample", top_p=1.0, top_k=40)
    episodes = run_episodes(NativeEngine(model, attention="triton"), prompts([4, 6, 3], seed=2), params, ScriptedEnv(),
                            ["a", "b", "c"], encode, decode, max_turns=2, max_tokens=30, keep_turns=True)
    ro = episodes.rollout
    assert ro.schedule.replayable and ro.schedule.attention == "triton" and int(episodes.turns.max()) > 1
    replayed = replay_logprobs(model, ro)
    assert torch.equal(replayed.logprobs[ro.action_mask], ro.logprobs[ro.action_mask])
