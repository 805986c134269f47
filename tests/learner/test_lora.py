"""LoRA RL in the learner (``learner.lora``): only the adapters train (gradients, optimizer state,
masters), the base stays frozen in its dtype, the KL reference is the base with the adapters off (no
copy), every policy loss runs, checkpointing and resume are exact, the engines get adapter tensors
alone (or merged weights), and ``lora/*`` norms are logged."""

import copy
import json

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


def test_changed_frac_counts_the_adapters_only():
    """The first update from B = 0 moves every B but no A (A's gradient is B^T times something: 0), so the
    changed share is B's share of the adapter elements — the frozen base does not count."""
    model, learner = _learner()
    adapters = _adapters(model)
    b_share = sum(v.numel() for k, v in adapters.items() if k.endswith("lora_B")) / sum(
        v.numel() for v in adapters.values())
    assert learner.update(synthetic_batch(seed=0))["sync/changed_frac"] == pytest.approx(b_share, abs=1e-3)
    assert learner.update(synthetic_batch(seed=1))["sync/changed_frac"] > 0.99  # A moves too once B is not 0


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


def _saved_base_learner(tmp_path, seed=0, **cfg):
    """A LoRA learner on a base loaded from a directory (as a run loads its model.path)."""
    from rltt.model import load_looped

    base = tmp_path / "base"
    if not base.exists():
        tiny_policy(seed, hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=32,
                    num_key_value_heads=2).save_pretrained(base, safe_serialization=True)
    model = load_looped(base)  # rank 16: each tensor's fixed overhead in optimizer.pt (~0.3 kB) stays below 5 %
    return base, model, Learner(model, LearnerConfig(lr=1e-2, micro_batch_size=2, lora=LoraSection(16, 32.0), **cfg),
                                AlgorithmConfig(kl_coef=0.1), batch_size=4, max_len=8)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_not_the_base(tmp_path, dtype):
    from rltt.model import load_looped

    base, model, learner = _saved_base_learner(tmp_path, dtype=dtype)
    for seed in range(2):
        learner.update(synthetic_batch(seed=seed))
    learner.save(tmp_path / "ckpt")
    files = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    assert not any(p.name == "model.safetensors" for p in files)
    adapters = sum(v.numel() * v.element_size() for v in _adapters(model).values())
    optimizer = learner.backend.optimizer.state_dict()["state"].values()
    state = sum(v.numel() * v.element_size() for s in optimizer for v in s.values() if v.dim() > 0)
    state += sum(m.numel() * m.element_size() for m in (learner.backend.masters or {}).values())
    assert sum(p.stat().st_size for p in files) <= 1.05 * (adapters + state)
    identity = json.loads((tmp_path / "ckpt" / "base.json").read_text())
    assert identity["path"] == str(base) and identity["dtype"] == "float32" and len(identity["sha256"]) == 64
    loaded = load_looped(tmp_path / "ckpt").state_dict()  # base + adapters, what merge / eval / generate load
    for k, v in model.state_dict().items():  # the fp32 base as on disk (a bf16 learner trains it cast)
        assert loaded[k].dtype == torch.float32 and torch.equal(loaded[k].to(v.dtype), v), k


def test_a_checkpoint_is_refused_on_another_or_a_missing_base(tmp_path):
    from rltt.errors import RlttError
    from rltt.model import load_looped

    base, _, learner = _saved_base_learner(tmp_path)
    learner.update(synthetic_batch(seed=0))
    learner.save(tmp_path / "ckpt")
    _, _, other = _saved_base_learner(tmp_path / "other", seed=1)  # another base: same shapes, other weights
    with pytest.raises(RlttError, match=f"{tmp_path / 'ckpt'}.*{base}.*{tmp_path / 'other' / 'base'}"):
        other.load(tmp_path / "ckpt")
    tiny_policy(1, hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=32,
                num_key_value_heads=2).save_pretrained(base, safe_serialization=True)  # the base changed on disk
    with pytest.raises(RlttError, match=f"{tmp_path / 'ckpt'}: holds LoRA adapters trained on the base {base}"):
        load_looped(tmp_path / "ckpt")
    import shutil

    shutil.rmtree(base)
    with pytest.raises(RlttError, match=f"{tmp_path / 'ckpt'}: .* its base {base} is missing"):
        load_looped(tmp_path / "ckpt")
