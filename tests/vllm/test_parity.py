"""VllmEngine against the native engine and the learner: greedy tokens and exits, sampled log-probs,
stops, groups and seeds. Two engines for the module: a pre-norm LoopLM with T = 2 (given as a model
object) and an imported Ouro checkpoint with T = 4 (sandwich norms, carried normed state)."""

from __future__ import annotations

import pytest
import torch

from rltt.errors import RlttError
from rltt.model import load_ouro
from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs
from tests.rollout.helpers import dense_logprobs
from tests.model.test_ouro_import import CFG as OURO_CFG
from tests.model.test_ouro_import import write_ouro_checkpoint
from tests.vllm.helpers import ENGINE_OPTIONS, PROMPTS, looped_model, needs_vllm

pytestmark = [pytest.mark.heavy, pytest.mark.slow, needs_vllm]

POLICIES = ["final", "fixed:2", "threshold:0.5", "sample"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from rltt.vllm.vllm_engine import VllmEngine

    pre = looped_model(num_loops=2, seed=0)
    ouro_dir = tmp_path_factory.mktemp("ouro") / "ckpt"
    write_ouro_checkpoint(ouro_dir, dict(OURO_CFG, vocab_size=128, hidden_size=128, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=192, total_ut_steps=4,
                                         early_exit_threshold=0.5))
    ouro = load_ouro(ouro_dir)
    assert ouro.config.num_loops == 4 and ouro.config.norm_placement == "ouro"
    built = {"pre-T2": (pre, VllmEngine(pre, **ENGINE_OPTIONS)),
             "ouro-T4": (ouro, VllmEngine(ouro_dir, **ENGINE_OPTIONS))}
    yield built
    for _, engine in built.values():
        engine.close()


def greedy(policy: str, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=10, exit_policy=policy, schedule="dense", seed=5, **kw)


def assert_same_completions(a, b):
    assert torch.equal(a.completion_lengths, b.completion_lengths)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.exit_steps, b.exit_steps)
    assert a.finish_reasons == b.finish_reasons


@pytest.mark.parametrize("name", ["pre-T2", "ouro-T4"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_and_exits_equal_native(engines, name, policy):
    model, engine = engines[name]
    params = greedy(policy)
    got, want = engine.generate(PROMPTS, params), NativeEngine(model).generate(PROMPTS, params)
    assert_same_completions(got, want)
    exits = got.exit_steps[got.completion_mask]
    if policy.startswith("fixed"):
        assert (exits == 2).all()
    elif policy != "final":  # the gate really decided: tokens exit at different steps
        assert exits.unique().numel() > 1
    # raw log-probs and the gates native computed (it leaves skipped steps NaN) agree closely
    mask = got.completion_mask
    assert torch.allclose(got.logprobs[mask], want.logprobs[mask], atol=1e-4)
    seen = ~torch.isnan(want.gate_probs)
    assert torch.allclose(got.gate_probs[seen], want.gate_probs[seen], atol=1e-5)
    assert got.schedule.kind == "vllm" and got.params.seed == 5


@pytest.mark.parametrize("name", ["pre-T2", "ouro-T4"])
def test_sampled_logprobs_equal_learner_dense_logprobs(engines, name):
    model, engine = engines[name]
    for policy, temperature, top_k in (("sample", 0.8, 0), ("threshold:0.5", 1.0, 20)):
        params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=12, n=2, exit_policy=policy,
                                schedule="dense", seed=11)
        batch = engine.generate(PROMPTS, params)
        mask = batch.completion_mask
        assert int(mask.sum()) > 40
        with torch.no_grad():
            raw = dense_logprobs(model, batch).exit
            tempered = dense_logprobs(model, batch, temperature=temperature).exit
        assert (batch.logprobs[mask] - raw[mask]).abs().max() <= 1e-4
        assert (batch.tempered_logprobs[mask] - tempered[mask]).abs().max() <= 1e-4
        assert (batch.logprobs[~mask] == 0).all() and (batch.exit_steps[~mask] == 0).all()
        assert batch.exit_steps[mask].min() >= 1 and batch.exit_steps[mask].max() <= model.config.num_loops


def test_seeds_groups_and_prompt_seeds(engines):
    _, engine = engines["pre-T2"]
    base = dict(temperature=1.0, max_new_tokens=8, schedule="dense", exit_policy="sample")
    a = engine.generate(PROMPTS[:3], SamplingParams(n=3, seed=7, **base))
    b = engine.generate(PROMPTS[:3], SamplingParams(n=3, seed=7, **base))
    assert_same_completions(a, b)  # same seed, same samples
    assert a.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert a.num_rows == 9 and len({tuple(a.completion(r)) for r in range(3)}) > 1  # a group's rows differ
    c = engine.generate(PROMPTS[:3], SamplingParams(n=3, seed=8, **base))
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # a prompt's samples under prompt_seeds equal a one-prompt call with that seed, whatever shares the call
    seeds = [101, 202, 303]
    together = engine.generate(PROMPTS[:3], SamplingParams(n=2, prompt_seeds=seeds, **base))
    for i, s in enumerate(seeds):
        alone = engine.generate([PROMPTS[i]], SamplingParams(n=2, seed=s, **base))
        for j in range(2):
            assert together.completion(2 * i + j) == alone.completion(j)
            assert together.exit_steps[2 * i + j].tolist() == alone.exit_steps[j].tolist()


def test_stop_tokens_and_stop_strings_match_native(engines):
    model, engine = engines["pre-T2"]
    native = NativeEngine(model)
    free = native.generate(PROMPTS, greedy("threshold:0.5"))
    stop_id = free.completion(0)[3]

    def decoder(ids):
        return " ".join(f"<{i}>" for i in ids)

    stop_string = f"<{free.completion(2)[2]}>"
    params = greedy("threshold:0.5", stop_token_ids=[stop_id], stop_strings=[stop_string], decoder=decoder)
    got, want = engine.generate(PROMPTS, params), native.generate(PROMPTS, params)
    assert_same_completions(got, want)
    assert got.completion(0)[-1] == stop_id and got.finish_reasons[0] == "stop"
    assert stop_string in decoder(got.completion(2)) and got.finish_reasons[2] == "stop"
    assert "length" in got.finish_reasons


def test_bad_settings_are_one_line_errors(engines):
    model, engine = engines["pre-T2"]
    with pytest.raises(RlttError, match="SamplingParams.schedule.*only 'dense'") as err:
        engine.generate(PROMPTS, SamplingParams(schedule="deferred"))
    assert "\n" not in str(err.value)
    batch = engine.generate(PROMPTS[:1], greedy("final"))
    with pytest.raises(RlttError, match="vLLM rollout has no pass record"):
        replay_logprobs(model, batch)
    with pytest.raises(RlttError, match="prompts\\[0\\]"):
        engine.generate([[500]], greedy("final"))
