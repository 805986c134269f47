"""The torch backend on a bf16 module trains in mixed precision: fp32 master weights, fp32 gradient
sums over the micro-batches, AdamW's moments in fp32, the module's weights the rounded masters; a
checkpoint holds the masters, so ``--resume`` continues exactly. An fp32 module trains as plain
AdamW on its own parameters (pinned bitwise against that reference)."""

import dataclasses

import pytest
import torch

from rltt.learner import SKIP_REASON, AlgorithmConfig, Learner, LearnerConfig
from rltt.learner.accumulation import BF16_ROUNDING, AccumulationProbe
from rltt.learner.backends import TorchBackend

from .helpers import synthetic_batch, tiny_policy


def _drifting_update(steps: int = 128):
    """One bf16 torch-backend update of a linear layer over ``steps`` micro-batches whose gradients
    grow from micro-batch to micro-batch (inputs 1 → 9), under the probe."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    backend = TorchBackend(model, LearnerConfig(lr=1e-3))
    with AccumulationProbe(backend) as probe:
        for i in range(steps):
            x = (1 + 8 * i / steps) * (1 + 0.1 * torch.rand(4, 16))
            backend.backward(model(x.to(torch.bfloat16)).float().sum())
        backend.step([])
    return probe.result


def test_bf16_micro_batch_gradients_sum_in_fp32():
    check = _drifting_update()
    assert check.micro_steps == 128 and check.grad_dtype == "bfloat16" and check.held_dtype == "float32"
    # the held gradient is the exact (float64) sum of the bf16 micro-batch gradients to fp32 rounding ...
    assert check.ok and check.error < 1e-6 and check.max_rel_error < 1e-6
    # ... where a bf16 running sum of the same gradients (the module's own .grad) is off by several roundings
    assert check.running_sum_error > 4 * BF16_ROUNDING


def test_learner_update_in_bf16_holds_fp32_sums_and_fp32_adam_state():
    learner = Learner(tiny_policy(seed=0), LearnerConfig(micro_batch_size=1, dtype="bf16", lr=1e-3),
                      AlgorithmConfig(track_kl=False), batch_size=4, max_len=8)
    assert all(p.dtype == torch.bfloat16 for p in learner.model.parameters())
    with AccumulationProbe(learner.backend) as probe:
        learner.update(synthetic_batch(B=4, seed=1))
    check = probe.result
    assert check.micro_steps == 4 and check.held_dtype == "float32" and check.ok and check.error < 1e-6
    assert all(p.grad is None for p in learner.model.parameters())  # the bf16 gradients were freed
    masters = learner.backend.masters
    assert masters.keys() == dict(learner.model.named_parameters()).keys()
    for name, p in learner.model.named_parameters():
        assert masters[name].dtype == torch.float32 and torch.equal(p, masters[name].to(torch.bfloat16)), name
    moments = [v for s in learner.backend.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments and all(v.dtype == torch.float32 for v in moments)


def _constant_gradient_steps(backend, weight: torch.nn.Parameter, grad: torch.Tensor, steps: int) -> None:
    """``steps`` updates of ``backend`` whose loss has the gradient ``grad`` for ``weight`` whatever its value."""
    for _ in range(steps):
        backend.backward((weight * grad.to(weight.dtype)).float().sum())
        backend.step([])


def test_updates_below_half_a_bf16_ulp_accumulate_in_the_masters():
    """lr 1e-4 on weights in [1, 2) (bf16 ulp 2⁻⁷ ≈ 7.8e-3): one AdamW step moves a weight by ~lr, far below
    half an ulp, so AdamW on the bf16 weights leaves them unchanged forever; the masters move exactly as
    fp32 AdamW does, and the bf16 weights are the fp32 reference rounded, step by step."""
    gen = torch.Generator().manual_seed(0)
    start = (1 + torch.rand(64, generator=gen)).to(torch.bfloat16)
    grad = (torch.randn(64, generator=gen)).to(torch.bfloat16).float()  # exact in bf16: the same for every side
    cfg = LearnerConfig(lr=1e-4, weight_decay=0.01)
    steps = 120

    naive = torch.nn.Parameter(start.clone())  # AdamW on the bf16 weights themselves (the former torch backend)
    opt = torch.optim.AdamW([naive], lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    reference = torch.nn.Parameter(start.float())  # fp32 AdamW from the same start, same gradients
    ref_opt = torch.optim.AdamW([reference], lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(start.clone())
    backend = TorchBackend(module, cfg)
    for _ in range(steps):
        for p, o in ((naive, opt), (reference, ref_opt)):
            (p * grad.to(p.dtype)).float().sum().backward()
            torch.nn.utils.clip_grad_norm_([p], cfg.grad_clip)
            o.step()
            o.zero_grad(set_to_none=True)
        _constant_gradient_steps(backend, module.weight, grad, 1)
        assert torch.equal(module.weight, reference.to(torch.bfloat16))  # the rounded masters ...
        assert torch.equal(backend.masters["weight"], reference)  # ... of bitwise fp32 AdamW
    assert torch.equal(naive, start)  # every bf16 step was lost
    moved = module.weight.float() != start.float()
    assert moved.sum() > 48  # 120 steps of ~1e-4: most weights crossed half an ulp
    assert float((module.weight.detach().float() - start.float()).abs().max()) >= 2 ** -7


def test_fp32_module_trains_as_plain_adamw_bitwise():
    """An fp32 module: no masters, no hooks; the same weights as AdamW + clipping on the module itself."""
    cfg = LearnerConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    backend = TorchBackend(model, cfg)
    assert getattr(backend, "masters", None) is None and backend.optimizer.param_groups[0]["params"] == list(model.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        xs = [torch.randn(3, 8, generator=gen) for _ in range(3)]
        for x in xs:
            backend.backward(model(x).pow(2).mean())
            reference(x).pow(2).mean().backward()
        norms, skipped = backend.step([])
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert skipped is None and norms["grad_norm/total"] > 0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


# -- checkpoints -----------------------------------------------------------------------------------
def _bf16_learner(seed: int = 0) -> Learner:
    return Learner(tiny_policy(seed=seed), LearnerConfig(micro_batch_size=2, dtype="bf16", lr=1e-3),
                   AlgorithmConfig(track_kl=False), batch_size=4, max_len=8)


def _state(learner: Learner) -> dict[str, torch.Tensor]:
    out = {f"weight:{k}": v.detach().clone() for k, v in learner.model.state_dict().items()}
    out |= {f"master:{k}": v.detach().clone() for k, v in learner.backend.masters.items()}
    for i, s in learner.backend.optimizer.state_dict()["state"].items():
        out |= {f"adam:{i}:{k}": v.clone() for k, v in s.items()}
    return out


def test_bf16_resume_is_exact(tmp_path):
    ran = _bf16_learner()
    ran.update(synthetic_batch(seed=0))
    ran.save(tmp_path / "ckpt")
    for seed in (1, 2):
        ran.update(synthetic_batch(seed=seed))
    resumed = _bf16_learner()  # the same starting policy, then the checkpoint
    resumed.load(tmp_path / "ckpt")
    for seed in (1, 2):
        resumed.update(synthetic_batch(seed=seed))
    a, b = _state(ran), _state(resumed)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    # the masters are finer than the weights: a resume from the bf16 weights alone would start elsewhere
    saved = torch.load(tmp_path / "ckpt" / "optimizer.pt", weights_only=True)["masters"]
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in saved.values())


def test_a_checkpoint_without_masters_rebuilds_them_from_its_weights(tmp_path, capsys):
    ran = _bf16_learner()
    ran.update(synthetic_batch(seed=0))
    ran.save(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "optimizer.pt"
    state = torch.load(path, weights_only=True)
    del state["masters"]  # as a checkpoint written before the masters were saved
    torch.save(state, path)
    resumed = _bf16_learner()
    resumed.load(tmp_path / "ckpt")
    notes = [line for line in capsys.readouterr().err.splitlines() if "master" in line]
    assert len(notes) == 1 and notes[0].endswith("optimizer.pt holds no fp32 master weights; rebuilding them "
                                                  "from the checkpoint's bfloat16 weights"), notes
    weights = dict(resumed.model.named_parameters())
    assert all(torch.equal(m, weights[k].float()) for k, m in resumed.backend.masters.items())
    assert all(torch.equal(weights[k], p) for k, p in ran.model.named_parameters())
    assert resumed.backend.updates == ran.backend.updates
    assert SKIP_REASON not in resumed.update(synthetic_batch(seed=1))


def test_guard_reads_the_fp32_gradients_and_a_skip_changes_nothing():
    learner = _bf16_learner()
    learner.update(synthetic_batch(seed=0))
    before = _state(learner)
    nan = synthetic_batch(seed=1)
    advantages = nan.advantages.clone()
    advantages[1] = float("nan")
    metrics = learner.update(dataclasses.replace(nan, advantages=advantages))
    assert metrics[SKIP_REASON] == "loss is nan"
    after = _state(learner)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert all(m.grad is None for m in learner.backend.masters.values())
    # a finite loss with a non-finite gradient: named on the fp32 master gradient
    hook = learner.policy.model.norm.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    try:
        metrics = learner.update(synthetic_batch(seed=2))
    finally:
        hook.remove()
    assert metrics[SKIP_REASON] == "non-finite gradient in 1 tensor(s), first module.model.norm.weight"
    assert [k for k in before if not torch.equal(before[k], _state(learner)[k])] == []


def test_an_fp32_learner_resumed_from_masters_takes_them(tmp_path):
    ran = _bf16_learner()
    ran.update(synthetic_batch(seed=0))
    ran.save(tmp_path / "ckpt")
    fp32 = Learner(tiny_policy(seed=0), LearnerConfig(micro_batch_size=2, lr=1e-3), AlgorithmConfig(track_kl=False),
                   batch_size=4, max_len=8)
    fp32.load(tmp_path / "ckpt")
    assert fp32.backend.masters is None
    assert all(torch.equal(p, ran.backend.masters[k]) for k, p in fp32.model.named_parameters())


def test_masters_that_do_not_match_the_model_are_refused(tmp_path):
    from rltt.errors import RlttError

    ran = _bf16_learner()
    ran.save(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "optimizer.pt"
    state = torch.load(path, weights_only=True)
    state["masters"].pop(next(iter(state["masters"])))
    torch.save(state, path)
    with pytest.raises(RlttError, match="fp32 master weights do not match") as err:
        _bf16_learner().load(tmp_path / "ckpt")
    assert "\n" not in str(err.value)


def test_a_rebuilt_backend_on_the_same_module_gets_the_gradients():
    """A second backend built on a bf16 module (a rebuilt learner) sums the gradients into its own
    masters: the first backend's hooks are removed, and neither steals nor drops the gradient."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    grad = torch.arange(8, dtype=torch.float32)
    first = TorchBackend(module, LearnerConfig(lr=1e-3))
    second = TorchBackend(module, LearnerConfig(lr=1e-3))
    second.backward((module.weight * grad.to(torch.bfloat16)).float().sum())
    assert torch.equal(second.masters["weight"].grad, grad)
    assert first.masters["weight"].grad is None
    second.step([])


def _changed_frac(dtype: str, lr: float, epochs: int = 1, rollout_dtype=None):
    """``sync/changed_frac`` of three updates, each checked against its definition: the share of the
    trained elements whose value in the engines' dtype differs after the update from before it."""
    learner = Learner(tiny_policy(seed=0), LearnerConfig(dtype=dtype, lr=lr, micro_batch_size=2),
                      AlgorithmConfig(track_kl=False, ppo_epochs=epochs), batch_size=4, max_len=8,
                      rollout_dtype=rollout_dtype)
    engines = learner.rollout_dtype
    fractions = []
    for seed in range(3):
        before = {n: p.detach().to(engines, copy=True) for n, p in learner.model.named_parameters()}
        fraction = learner.update(synthetic_batch(B=4, seed=seed))["sync/changed_frac"]
        after = {n: p.detach().to(engines) for n, p in learner.model.named_parameters()}
        assert fraction == pytest.approx(sampled_fraction(before, after), rel=1e-9)  # float64 sums in other orders
        exact = sum(int((after[n] != v).sum()) for n, v in before.items()) / sum(v.numel() for v in before.values())
        assert abs(fraction - exact) <= 0.05  # the sample's estimate of the exact count
        fractions.append(fraction)
    return fractions


def sampled_fraction(before: dict, after: dict, sample: int = 256) -> float:
    """The definition of ``sync/changed_frac``, written apart: per tensor of n elements, the share of changed
    values among every ⌈n / sample⌉-th element of its flat view (all of a tensor of at most ``sample``), the
    tensors weighted by n."""
    changed = total = 0.0
    for name, old in before.items():
        n = old.numel()
        stride = max(1, -(-n // sample))
        picked = old.reshape(-1)[::stride]
        changed += int((after[name].reshape(-1)[::stride] != picked).sum()) / picked.numel() * n
        total += n
    return changed / total


def test_changed_frac_near_one_for_an_fp32_learner_at_a_normal_lr():
    assert min(_changed_frac("fp32", 1e-3)) > 0.9  # every element with a gradient moves
    assert min(_changed_frac("fp32", 1e-3, rollout_dtype=torch.bfloat16)) > 0.9  # and crosses a bf16 ulp


def test_changed_frac_near_zero_for_a_bf16_learner_at_lr_1e7():
    """Weights ~0.02 (bf16 ulp 2⁻¹³ ≈ 1.2e-4): a step of ~1e-7 is far below half an ulp, so the rounded
    masters stay put — counted while rounding (one step) and against a copy (two epochs) alike."""
    assert max(_changed_frac("bf16", 1e-7)) < 0.01
    assert max(_changed_frac("bf16", 1e-7, epochs=2)) < 0.01
    assert min(_changed_frac("bf16", 1e-3)) > 0.9


def test_changed_frac_of_a_skipped_update_is_zero():
    learner = Learner(tiny_policy(seed=0), LearnerConfig(dtype="bf16", lr=1e-3, micro_batch_size=2),
                      AlgorithmConfig(track_kl=False), batch_size=4, max_len=8)
    batch = synthetic_batch(B=4, seed=0)
    metrics = learner.update(dataclasses.replace(batch, advantages=batch.advantages * float("nan")))
    assert SKIP_REASON in metrics and metrics["sync/changed_frac"] == 0.0
