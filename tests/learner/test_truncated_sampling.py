"""Top-k/top-p rollouts through the learner: the PPO ratio is exactly 1 at the rollout weights and
the sampler–learner mismatch stays rounding-sized, because the learner scores the kept set the
sampler drew from (``LearnerBatch.kept_floor``)."""

import copy
from dataclasses import replace

import pytest
import torch

from rltt.learner import AlgorithmConfig, Learner, LearnerBatch, LearnerConfig
from rltt.rollout import NativeEngine, SamplingParams

from tests.rollout.helpers import prompts, tiny_model


def _rollout(dtype, schedule, top_p, top_k, head_scale=60.0, **model_fields):
    model = tiny_model(dtype=torch.float32, **model_fields)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)  # 60: peaked logits, truncation drops real mass
    model = model.to(dtype)
    params = SamplingParams(temperature=0.8, top_p=top_p, top_k=top_k, max_new_tokens=6, n=2, seed=7,
                            exit_policy="sample", schedule=schedule)
    batch = NativeEngine(model).generate(prompts([4, 3], seed=2), params)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return model, LearnerBatch.from_rollout(batch, advantages)


def _update(model, batch, dtype, **algo):
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=2, dtype="bf16" if dtype == torch.bfloat16 else "fp32")
    learner = Learner(copy.deepcopy(model).float(), cfg, AlgorithmConfig(track_kl=False, **algo),
                      batch_size=batch.size, max_len=6, rollout_dtype=dtype)
    return learner.update(batch)


CASES = [(torch.float32, s, p, k) for s in ("dense", "deferred") for p, k in ((0.7, 0), (1.0, 4))] + \
    [(torch.bfloat16, "deferred", 0.8, 5)]


@pytest.mark.parametrize("dtype,schedule,top_p,top_k", CASES)
def test_ratio_is_exactly_one_at_the_rollout_weights_under_truncation(dtype, schedule, top_p, top_k):
    model, batch = _rollout(dtype, schedule, top_p, top_k)
    assert batch.kept_floor is not None and (batch.kept_floor[batch.target_mask] >= 0).any()
    metrics = _update(model, batch, dtype)
    assert metrics["policy/ratio_mean"] == 1.0 and metrics["policy/ratio_max"] == 1.0
    assert metrics["policy/ratio_min"] == 1.0 and metrics["policy/clip_frac"] == 0.0
    if dtype == torch.float32:
        assert metrics["mismatch/max_abs"] < 1e-4  # the learner scores the sampler's kept set
    # bf16: peaked logits round coarsely (a bf16 ulp at |z| ~ 60 is 0.25), see the flat-logit test below
    if dtype == torch.float32 and schedule == "dense" and top_k == 0:
        # scored over the whole vocabulary, the same tokens read as a large mismatch
        full = _update(model, replace(batch, kept_floor=None), dtype)
        assert full["mismatch/max_abs"] > 1e-2
        assert full["policy/ratio_mean"] == 1.0  # the hybrid form still anchors the value


def test_a_bf16_rollouts_kept_set_is_the_learners_on_a_32k_vocabulary():
    """Flat logits of a bf16 head over V = 32768: rounding makes ties at the top-k/top-p boundary.
    The learner decides membership on its logits rounded to bf16 (``kept_dtype``), as the sampler
    did, so sampler and learner log-probs differ by rounding alone; deciding on the fp32 logits
    splits those ties differently and the mismatch reaches a tenth of a nat."""
    model, batch = _rollout(torch.bfloat16, "deferred", 0.8, 20, head_scale=1.0, vocab_size=32768, hidden_size=16,
                            intermediate_size=32)
    assert batch.kept_dtype == torch.bfloat16 and (batch.kept_floor[batch.target_mask] >= 0).all()
    metrics = _update(model, batch, torch.bfloat16)
    assert metrics["policy/ratio_mean"] == 1.0 and metrics["policy/ratio_max"] == 1.0
    assert metrics["mismatch/max_abs"] < 0.01


def test_learner_batches_carry_the_floors_at_the_token_positions():
    model, batch = _rollout(torch.float32, "dense", 0.7, 0)
    floors = batch.kept_floor
    assert floors.shape == batch.input_ids.shape
    assert (floors[~batch.target_mask] == -1).all()
    assert batch.kept_dtype == torch.float32  # the dtype of the sampler's logits
    both = LearnerBatch.cat([replace(batch, kept_floor=None, kept_dtype=None), batch])
    assert both.kept_dtype == torch.float32
    both = LearnerBatch.cat([batch, replace(batch, kept_floor=None)])
    assert torch.equal(both.kept_floor[: batch.size], floors)
    assert (both.kept_floor[batch.size:] == -1).all()
    assert torch.equal(batch.select(slice(1, 3)).kept_floor, floors[1:3])
