"""The learner's non-finite guard: a NaN/inf loss or gradient skips the optimizer step — the
weights and the optimizer state stay bitwise, the gradients are dropped, ``version`` stays."""

import dataclasses

import pytest
import torch

from rltt.learner import SKIP_REASON, AlgorithmConfig, Learner, LearnerConfig

from .helpers import synthetic_batch, tiny_policy


def _snapshot(learner):
    weights = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    state = learner.backend.optimizer.state_dict()["state"]
    moments = {(i, k): v.clone() for i, s in state.items() for k, v in s.items() if torch.is_tensor(v)}
    return weights, moments


def _assert_same(before, after):
    for old, new in zip(before, after):
        assert old.keys() == new.keys()
        assert all(torch.equal(old[k], new[k]) for k in old)


def _learner(**algo):
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=2)
    return Learner(tiny_policy(), cfg, AlgorithmConfig(**algo), batch_size=4, max_len=8)


def _nan_batch(seed=1):
    batch = synthetic_batch(seed=seed)
    advantages = batch.advantages.clone()
    advantages[1] = float("nan")
    return dataclasses.replace(batch, advantages=advantages)


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_nan_loss_skips_the_update(epochs):
    learner = _learner(ppo_epochs=epochs)
    first = learner.update(synthetic_batch(seed=0))  # a real step: the optimizer has moments to keep
    assert SKIP_REASON not in first and learner.version == 1
    before, updates = _snapshot(learner), learner.backend.updates
    metrics = learner.update(_nan_batch())
    assert metrics[SKIP_REASON] == "loss is nan"
    assert learner.version == 1  # the engines are not reloaded
    _assert_same(before, _snapshot(learner))
    assert all(p.grad is None for p in learner.model.parameters())
    assert learner.backend.updates == updates  # the LR warmup counts applied updates only
    after = learner.update(synthetic_batch(seed=2))  # and training goes on from the same weights
    assert SKIP_REASON not in after and learner.version == 2
    assert any(not torch.equal(before[0][k], v) for k, v in learner.model.state_dict().items())


def test_a_non_finite_gradient_with_a_finite_loss_skips_the_update():
    learner = _learner()
    learner.update(synthetic_batch(seed=0))
    before = _snapshot(learner)
    weight = learner.policy.model.norm.weight
    hook = weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    metrics = learner.update(synthetic_batch(seed=1))
    hook.remove()
    assert torch.isfinite(torch.tensor(metrics["loss/total"]))
    assert metrics[SKIP_REASON] == "non-finite gradient in 1 tensor(s), first module.model.norm.weight"
    assert learner.version == 1
    _assert_same(before, _snapshot(learner))


def test_lr_1e30_gives_finite_weights_and_skipped_steps():
    """The probe of the issue: a huge learning rate blows the loss up; no step with a non-finite
    loss or gradient ever writes its weights."""
    model = tiny_policy()
    learner = Learner(model, LearnerConfig(lr=1e30, micro_batch_size=2), AlgorithmConfig(), batch_size=4, max_len=8)
    skipped = []
    for seed in range(6):
        before = _snapshot(learner)[0]
        metrics = learner.update(synthetic_batch(seed=seed))
        if SKIP_REASON in metrics:
            skipped.append(seed)
            _assert_same([before], [_snapshot(learner)[0]])
        assert all(torch.isfinite(v).all() for v in learner.model.state_dict().values())
    assert skipped and learner.version == 6 - len(skipped)
