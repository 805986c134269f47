"""LoRA RL in the learner (``learner.lora``): only the adapters train (gradients, optimizer state,
masters), the base stays frozen in its dtype, the KL reference is the base with the adapters off (no
copy), every policy loss runs, checkpointing and resume are exact, the engines get adapter tensors
alone (or merged weights), and ``lora/*`` norms are logged."""

import copy

import pytest
import torch

from rltt.learner import AlgorithmConfig, Learner, LearnerConfig, score_tokens
from rltt.learner.settings import LoraSection
from rltt.model.adapters import adapters_disabled, is_adapter
from rltt.objectives.policy_losses import POLICY_LOSSES

from .helpers import synthetic_batch, tiny_policy

LORA = LoraSection(rank=4, alpha=8.0)


def _learner(lora=LORA, seed=0, **cfg):
    algo = cfg.pop("algo", AlgorithmConfig(kl_coef=0.1))
    model = tiny_policy(seed)
    return model, Learner(model, LearnerConfig(lr=1e-2, micro_batch_size=2, lora=lora, **cfg), algo,
                          batch_size=4, max_len=8)


def _adapters(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if is_adapter(k)}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_only_the_adapters_train_and_the_base_stays_bitwise(dtype):
    base = {k: v.clone() for k, v in tiny_policy(0).state_dict().items()}
    model, learner = _learner(dtype=dtype)
    assert learner.ref_model is None and learner.has_reference  # no reference copy
    trained = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter(n) for n in trained)
    before = _adapters(model)
    for seed in range(2):
        metrics = learner.update(synthetic_batch(seed=seed))
    state = model.state_dict()
    for name, value in base.items():  # frozen, in the learner's dtype
        cast = value.to(torch.bfloat16) if dtype == "bf16" else value
        assert state[name].dtype == cast.dtype and torch.equal(state[name], cast), name
    assert any(not torch.equal(before[k], v) for k, v in _adapters(model).items())
    optimized = {id(p) for group in learner.backend.optimizer.param_groups for p in group["params"]}
    assert len(optimized) == len(trained)  # optimizer (and masters) of the adapters only
    if dtype == "bf16":
        assert set(learner.backend.masters) == set(trained)
    assert metrics["lora/update_norm/q_proj"] > 0 and "lora/B_norm/down_proj" in metrics


def test_the_reference_is_the_base_with_adapters_off():
    model, learner = _learner()
    learner.update(synthetic_batch(seed=0))
    batch = synthetic_batch(seed=1)
    prepared, _ = learner.prepare(batch)
    base = tiny_policy(0).eval()
    from rltt.learner.loss import kl_logprob

    # the learner's micro-batches through its (packed) score forward: the same operations on the same
    # shapes, so the same bits on any CPU (another batch shape may round its GEMMs otherwise)
    with torch.no_grad():
        expected = torch.cat([(s := score_tokens(base, mb, pack=learner.cfg.pack_sequences))
                              .to_rows(kl_logprob(s, learner.algo)) for mb in batch.micro_batches(learner.micro)])
    assert torch.equal(prepared.ref_logprobs, expected)
    with adapters_disabled(model), torch.no_grad():  # and the policy differs from it once trained
        assert torch.equal(score_tokens(model, batch).logprobs, score_tokens(base, batch).logprobs)
    assert not torch.equal(score_tokens(model, batch).logprobs.detach(), score_tokens(base, batch).logprobs)


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_every_policy_loss_trains_the_adapters(loss):
    model, learner = _learner(algo=AlgorithmConfig(loss=loss, kl_coef=0.05, ppo_epochs=2))
    before = _adapters(model)
    metrics = learner.update(synthetic_batch(seed=3))
    assert learner.version == 1 and torch.isfinite(torch.tensor(metrics["loss/total"]))
    assert any(not torch.equal(before[k], v) for k, v in _adapters(model).items())


@pytest.mark.parametrize("per_loop", [False, True])
def test_activation_checkpointing_gives_the_same_update(per_loop):
    lora = LoraSection(rank=4, alpha=8.0, per_loop=per_loop)
    plain, a = _learner(lora)
    ckpt, b = _learner(lora, activation_checkpointing=True)
    for seed in range(2):
        a.update(synthetic_batch(seed=seed))
        b.update(synthetic_batch(seed=seed))
    for k, v in _adapters(plain).items():
        assert torch.equal(v, _adapters(ckpt)[k]), k


def test_resume_equals_the_uninterrupted_run(tmp_path):
    batches = [synthetic_batch(seed=s) for s in range(3)]
    whole, learner = _learner(dtype="bf16", warmup_steps=2)
    for batch in batches:
        learner.update(batch)
    first, part = _learner(dtype="bf16", warmup_steps=2)
    part.update(batches[0])
    part.update(batches[1])
    part.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter" / "adapter_config.json").exists()
    resumed_model, resumed = _learner(dtype="bf16", warmup_steps=2)  # the starting policy, then the checkpoint
    resumed.load(tmp_path / "ckpt")
    assert resumed.version == 2
    resumed.update(batches[2])
    for k, v in _adapters(whole).items():
        assert torch.equal(v, _adapters(resumed_model)[k]), k
    for k, v in whole.state_dict().items():
        assert torch.equal(v, resumed_model.state_dict()[k]), k


def test_rollout_state_dict_sends_the_adapters_or_the_merged_weights():
    model, learner = _learner()
    learner.update(synthetic_batch(seed=0))
    version, tensors = learner.rollout_state_dict()
    assert version == 1 and tensors and all(is_adapter(k) for k in tensors)
    assert set(tensors) == set(_adapters(model))
    learner.sync = "merged"
    _, merged = learner.rollout_state_dict()
    assert not any(is_adapter(k) for k in merged)
    assert set(merged) == {k for k in model.state_dict() if not is_adapter(k)}


def test_adapter_only_weights_refresh_a_native_engine_copy():
    from rltt.rollout import SamplingParams
    from rltt.rollout.native import NativeEngine

    model, learner = _learner(algo=AlgorithmConfig())
    engine_model = copy.deepcopy(model).eval()  # a separate engine copy with the same (zero-B) adapters
    engine = NativeEngine(engine_model)
    learner.update(synthetic_batch(seed=0))
    engine.load_weights(*learner.rollout_state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(v, engine_model.state_dict()[k]), k
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0, seed=0)
    shared = NativeEngine(model)  # the learner's own module: the same rollout
    ours, theirs = engine.generate([[1, 2, 3]], params), shared.generate([[1, 2, 3]], params)
    assert torch.equal(ours.completion_ids, theirs.completion_ids) and torch.equal(ours.logprobs, theirs.logprobs)
