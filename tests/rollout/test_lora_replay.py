"""A LoRA run's native engine applies the adapters in its passes: replay stays bitwise with shared
and per-loop adapters on every projection, and after an adapter-only weight update."""

import pytest
import torch

from rltt.model.adapters import AdapterSpec, adapter_state_dict, attach_adapters
from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs

from .helpers import prompts, tiny_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_model(dtype, per_loop, seed=0):
    model = tiny_model(dtype=dtype)
    attach_adapters(model, AdapterSpec(4, 8.0, ALL, per_loop), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


@pytest.mark.parametrize("dtype,schedule,per_loop", [(torch.float32, "dense", False), (torch.float32, "deferred", True),
                                                     (torch.bfloat16, "deferred", False),
                                                     (torch.float32, "deferred", False)])
def test_lora_rollouts_replay_bitwise(dtype, schedule, per_loop):
    model = _lora_model(dtype, per_loop)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=8, n=2, seed=5, exit_policy="sample",
                            schedule=schedule)
    engine = NativeEngine(model)
    batch = engine.generate(prompts([3, 6], seed=2), params)
    replay = replay_logprobs(model, batch)
    assert torch.equal(replay.logprobs, batch.logprobs)
    assert torch.equal(replay.tempered_logprobs, batch.tempered_logprobs)
    # an adapter-only update: the engine serves the new adapters and replays them bitwise
    trained = _lora_model(dtype, per_loop, seed=3)
    engine.load_weights(1, adapter_state_dict(trained))
    moved = engine.generate(prompts([3, 6], seed=2), params)
    assert torch.equal(replay_logprobs(trained, moved).logprobs, moved.logprobs)
    assert not torch.equal(moved.logprobs, batch.logprobs)
