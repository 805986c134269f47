"""The exit half of the action: every rollout records log p_{t*} of each sampled token's exit, and
bitwise replay reproduces it (fp32 and bf16, dense and deferred, one chunk or several)."""

import pytest
import torch

from rltt.model.exits import exit_logprob
from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs

from .helpers import dense_logprobs, prompts, tiny_model

CASES = [(dtype, schedule) for dtype in (torch.float32, torch.bfloat16) for schedule in ("dense", "deferred")]


@pytest.mark.parametrize("dtype,schedule", CASES)
@pytest.mark.parametrize("chunk_rows", [None, 2])
def test_exit_logprobs_are_recorded_and_replayed_bitwise(dtype, schedule, chunk_rows):
    model = tiny_model(dtype=dtype)
    params = SamplingParams(temperature=0.9, max_new_tokens=8, n=2, seed=5, exit_policy="sample", schedule=schedule)
    batch = NativeEngine(model, chunk_rows=chunk_rows).generate(prompts([4, 7, 2], seed=3), params)
    mask = batch.action_mask
    assert batch.exit_logprobs.dtype == torch.float32 and batch.exit_logprobs.shape == batch.logprobs.shape
    assert torch.equal(batch.exit_logprobs, exit_logprob(batch.gate_probs, batch.exit_steps, mask))
    assert (batch.exit_logprobs[mask] <= 0).all() and (batch.exit_logprobs[mask] < 0).any()
    assert (batch.exit_logprobs[~mask] == 0).all()
    assert len(set(batch.exit_steps[mask].tolist())) > 1  # sampled exits: several steps
    replay = replay_logprobs(model, batch)
    assert torch.equal(replay.exit_logprobs, batch.exit_logprobs)
    assert torch.equal(replay.logprobs, batch.logprobs)


def test_the_recorded_exit_logprob_is_the_dense_forward_one():
    model = tiny_model()
    batch = NativeEngine(model).generate(prompts([5, 3]), SamplingParams(max_new_tokens=7, n=2, seed=1,
                                                                         exit_policy="sample"))
    dense = dense_logprobs(model, batch)
    want = dense.exit_probs.log().gather(0, (batch.exit_steps.clamp_min(1) - 1)[None])[0]
    mask = batch.action_mask
    assert (batch.exit_logprobs[mask] - want.detach()[mask]).abs().max() < 1e-5
