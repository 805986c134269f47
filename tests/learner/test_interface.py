"""The learner interface every backend satisfies: update bumps the version, the rollout weights
load into a NativeEngine, save/load resumes to the identical state (torch and DeepSpeed)."""

import copy

import pytest
import torch

from rltt.learner import AlgorithmConfig, Learner, LearnerAPI, LearnerConfig
from rltt.rollout import NativeEngine

from .helpers import synthetic_batch, tiny_policy

BACKENDS = [pytest.param("torch", id="torch"),
            pytest.param("deepspeed", id="deepspeed", marks=[pytest.mark.heavy, pytest.mark.slow])]


def _learner(backend: str, seed: int = 0) -> Learner:
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    cfg = LearnerConfig(backend=backend, lr=1e-2, micro_batch_size=2, warmup_steps=1)
    algo = AlgorithmConfig(policy_logprob="rltt", omega="learned", kl_coef=0.05)
    return Learner(tiny_policy(seed=seed), cfg, algo, batch_size=4, max_len=8)


def _state(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.rollout_state_dict()[1].items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_learner_interface(backend, tmp_path):
    learner = _learner(backend)
    assert isinstance(learner, LearnerAPI)
    assert learner.version == 0 and learner.rollout_state_dict()[0] == 0
    start = _state(learner)
    metrics = learner.update(synthetic_batch(seed=1))
    assert learner.version == 1 and "loss/total" in metrics

    # the rollout weights: every model tensor plus the learned loop weights, moved by the update
    version, tensors = learner.rollout_state_dict()
    assert version == 1
    assert set(tensors) == set(learner.policy.state_dict()) | {"loop_weight_logits"}
    assert not torch.equal(tensors["loop_weight_logits"], start["loop_weight_logits"])
    engine = NativeEngine(tiny_policy(seed=5))
    engine.load_weights(version, tensors)
    assert engine.weights_version == 1
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, tensors[name]), name
    assert torch.equal(engine.extra_weights["loop_weight_logits"], tensors["loop_weight_logits"])

    # save / load: a fresh learner built from the same starting policy (its frozen reference)
    # resumes to the same state and takes the same next update
    learner.save(tmp_path / "ckpt")
    resumed = _learner(backend)
    assert not torch.equal(_state(resumed)["loop_weight_logits"], tensors["loop_weight_logits"])
    resumed.load(tmp_path / "ckpt")
    assert resumed.version == 1
    saved = _state(learner)
    for name, value in _state(resumed).items():
        assert torch.equal(value, saved[name]), name
    batch = synthetic_batch(seed=2)
    a, b = learner.update(copy.deepcopy(batch)), resumed.update(copy.deepcopy(batch))
    assert a["loss/total"] == b["loss/total"] and a["grad_norm/total"] == b["grad_norm/total"]
    after, after_resumed = _state(learner), _state(resumed)
    for name, value in after.items():
        assert torch.equal(value, after_resumed[name]), name
    assert learner.version == resumed.version == 2


def test_rollout_weights_are_cast_to_the_engine_dtype_and_shared_when_they_match():
    model = tiny_policy()
    learner = Learner(model, LearnerConfig(dtype="bf16"), AlgorithmConfig(omega="learned", policy_logprob="rltt"),
                      batch_size=4, max_len=8, rollout_dtype=torch.float32)
    _, tensors = learner.rollout_state_dict()
    assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {torch.float32}
    shared = Learner(tiny_policy(), LearnerConfig(), AlgorithmConfig(), batch_size=4, max_len=8)
    _, tensors = shared.rollout_state_dict()
    engine = NativeEngine(shared.policy)  # the engine samples with the learner's own model
    assert all(tensors[k].data_ptr() == v.data_ptr() for k, v in engine.model.state_dict().items())
    engine.load_weights(*shared.rollout_state_dict())
    assert engine.weights_version == 0


def test_the_engine_refuses_foreign_or_missing_tensors():
    from rltt.errors import RlttError

    engine = NativeEngine(tiny_policy())
    tensors = dict(tiny_policy(seed=1).state_dict())
    with pytest.raises(RlttError, match="unexpected"):
        engine.load_weights(1, {**tensors, "something_else": torch.zeros(3)})
    tensors.pop("lm_head.weight")
    with pytest.raises(RlttError, match="missing"):
        engine.load_weights(1, tensors)
    assert engine.weights_version == 0
