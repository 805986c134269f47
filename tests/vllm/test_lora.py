"""LoRA adapters served by vLLM's own LoRA support (``VllmEngine(lora=...)``, ``rollout.vllm.lora:
adapters``): the engine samples the adapted policy — its log-probs are the learner's adapted
model's, greedy rows equal the native engine's on that model — an update of adapter tensors alone
replaces vLLM's one adapter and leaves the base as it was, and the plan counts vLLM's adapter slots
as the engine allocates them. One engine for the module."""

from __future__ import annotations

import copy
import os
import typing

import pytest
import torch

from rltt.errors import RlttError
from rltt.model.adapters import AdapterSpec, adapter_state_dict, attach_adapters
from rltt.rollout import NativeEngine, SamplingParams
from rltt.vllm.lora import VLLM_LORA_RANKS, check_served_adapters, lora_slot_rank
from tests.rollout.helpers import dense_logprobs
from tests.vllm.helpers import ENGINE_OPTIONS, PROMPTS, looped_model, needs_vllm

pytestmark = [pytest.mark.heavy, pytest.mark.slow, needs_vllm]

SPEC = AdapterSpec(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"))
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, exit_policy="threshold:0.5", schedule="dense", seed=5)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, exit_policy="sample", schedule="dense", seed=11)


def adapted(base, seed: int, scale: float = 0.3):
    """``base`` with shared adapters whose B is random (an update's worth of change and more)."""
    model = copy.deepcopy(base)
    attach_adapters(model, SPEC, seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def served():
    from rltt.vllm.vllm_engine import VllmEngine

    base = looped_model(num_loops=2, seed=0)
    engine = VllmEngine(base, lora=SPEC, **ENGINE_OPTIONS)
    yield base, engine
    engine.close()


def _max_diff(a, b, mask):
    return float((a[mask] - b[mask]).abs().max())


def test_vllm_serves_the_adapted_policy_and_swaps_adapters(served):
    base, engine = served
    # version 0: no adapter yet (B = 0 is the base's function): the base is served
    assert engine.lora_request is None
    got, want = engine.generate(PROMPTS, GREEDY), NativeEngine(base).generate(PROMPTS, GREEDY)
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.exit_steps, want.exit_steps)

    fingerprint = engine.llm.collective_rpc("rltt_fingerprint")
    folders = []
    for version, seed in ((1, 3), (2, 4)):
        model = adapted(base, seed)
        engine.load_weights(version, adapter_state_dict(model))
        assert engine.weights_version == version
        assert engine.llm.llm_engine.list_loras() == {engine.lora_request.lora_int_id}  # one adapter at a time
        folders.append(engine.lora_request.lora_path)
        # sampled log-probs: the adapted model's (as the learner scores them), far from the base's
        batch = engine.generate(PROMPTS, SAMPLED)
        mask = batch.completion_mask
        with torch.no_grad():
            assert _max_diff(batch.logprobs, dense_logprobs(model, batch).exit, mask) <= 1e-4
            assert _max_diff(batch.tempered_logprobs, dense_logprobs(model, batch, temperature=1.0).exit, mask) <= 1e-4
            assert _max_diff(batch.logprobs, dense_logprobs(base, batch).exit, mask) > 0.1
        # greedy rows and exits: the native engine's on the adapted model
        got, want = engine.generate(PROMPTS, GREEDY), NativeEngine(model).generate(PROMPTS, GREEDY)
        assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.exit_steps, want.exit_steps)
        assert engine.llm.collective_rpc("rltt_fingerprint") == fingerprint  # adapters alone: the base as it was
    assert not os.path.exists(folders[0]) and os.path.exists(folders[1])  # the replaced adapter's folder is gone


def test_bad_adapter_updates_are_one_line_errors(served, monkeypatch):
    base, engine = served
    state = adapter_state_dict(adapted(base, 5))
    version = engine.weights_version
    name = next(k for k in state if k.endswith("lora_A"))
    for bad in ({k: v for k, v in state.items() if k != name},  # one missing
                {**state, name: state[name][:, :2]}):  # one of another rank
        with pytest.raises(RlttError, match="adapter tensors do not match") as err:
            engine.load_weights(version + 1, bad)
        assert "\n" not in str(err.value)
    assert engine.weights_version == version
    monkeypatch.setattr(engine, "lora", None)  # an engine that serves no adapters is sent some
    with pytest.raises(RlttError, match="serves no LoRA adapters"):
        engine.load_weights(version + 1, state)


def test_the_plan_counts_the_adapter_slots_vllm_allocates(served):
    from rltt.planning.shapes import ModelShape

    base, engine = served
    measured = engine.llm.collective_rpc("rltt_lora_slots")[0]
    shape = ModelShape.of(base.config)
    assert measured["wrapped"] == 4 * base.config.num_hidden_layers  # qkv, o, gate_up, down of every layer
    assert measured["bytes"] == 4 * shape.vllm_lora_slot_parameters(lora_slot_rank(SPEC.rank))  # fp32


def test_served_ranks_are_vllms():
    from vllm.config.lora import MaxLoRARanks

    assert VLLM_LORA_RANKS == typing.get_args(MaxLoRARanks)
    assert [lora_slot_rank(r) for r in (1, 2, 8, 9, 512)] == [1, 8, 8, 16, 512]
    with pytest.raises(RlttError, match="rank <= 512"):
        lora_slot_rank(513)
    with pytest.raises(RlttError, match="per-loop adapters"):
        check_served_adapters(AdapterSpec(rank=4, alpha=8.0, targets=("q_proj",), per_loop=True))
