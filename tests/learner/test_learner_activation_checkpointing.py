"""``learner.activation_checkpointing: true`` changes no number: the learner's losses, metrics,
every parameter gradient and the updated weights are bitwise those of the run without it (fp32,
CPU) — padded and packed forwards, every policy log-prob (learned loop weights included), every
log-prob kernel, the torch and DeepSpeed backends, and a 3-step `rltt train`."""

import json
import os
from pathlib import Path

import pytest
import torch

from rltt.learner import AlgorithmConfig, Learner, LearnerConfig

from .helpers import run_worker, synthetic_batch, tiny_policy

#: metrics that measure time or the machine, not the computation
UNTIMED = ("time/", "throughput/", "memory/", "wall_time")


def computed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(UNTIMED)}


def train(checkpointing: bool, algo: AlgorithmConfig, pack: bool, updates: int = 2):
    """Two updates of a fresh tiny learner; the metrics, the gradients each optimizer step saw,
    and the final parameters (the learned loop weights included)."""
    model = tiny_policy(seed=1, num_hidden_layers=3, num_loops=3)
    learner = Learner(model, LearnerConfig(lr=1e-2, micro_batch_size=2, pack_sequences=pack,
                                           activation_checkpointing=checkpointing),
                      algo, batch_size=4, max_len=8)
    assert model.is_gradient_checkpointing == checkpointing
    if learner.ref_model is not None:
        assert not learner.ref_model.is_gradient_checkpointing  # the reference only scores without gradients
    grads, step = [], learner.backend.step

    def recording_step(losses=()):
        grads.append({n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None})
        return step(losses)

    learner.backend.step = recording_step
    metrics = [computed(learner.update(synthetic_batch(seed=s))) for s in range(updates)]
    return metrics, grads, {n: p.detach().clone() for n, p in learner.model.named_parameters()}


def assert_bitwise(a, b):
    metrics_a, grads_a, params_a = a
    metrics_b, grads_b, params_b = b
    assert metrics_a == metrics_b
    assert len(grads_a) == len(grads_b) > 0
    for step_a, step_b in zip(grads_a, grads_b):
        assert step_a.keys() == step_b.keys()
        for name in step_a:
            assert torch.equal(step_a[name], step_b[name]), name
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name


KINDS = {
    "exit": AlgorithmConfig(policy_logprob="exit", kl_coef=0.1),
    "final": AlgorithmConfig(policy_logprob="final", kl_coef=0.1, kl_on="policy"),
    "mixture": AlgorithmConfig(policy_logprob="mixture", kl_coef=0.1, ppo_epochs=2),  # the gate gets gradients
    "rltt": AlgorithmConfig(policy_logprob="rltt", omega="progressive", loss="reinforce"),
    "rltt-learned": AlgorithmConfig(policy_logprob="rltt", omega="learned", ppo_epochs=2),
}


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_updates_are_bitwise_those_without_checkpointing(kind, pack):
    without = train(False, KINDS[kind], pack)
    with_ckpt = train(True, KINDS[kind], pack)
    assert_bitwise(without, with_ckpt)
    if kind == "rltt-learned":
        assert "loop_weight_logits" in with_ckpt[1][0]
    if kind == "mixture":
        assert any("exit_gate" in name for name in with_ckpt[1][0])


@pytest.mark.parametrize("impl", ["chunked", "reference", "triton"])
def test_every_logprob_kernel(impl, monkeypatch):
    if impl == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv("RLTT_LOGPROB_IMPL", impl)
    algo = AlgorithmConfig(policy_logprob="mixture", kl_coef=0.1)
    assert_bitwise(train(False, algo, pack=True, updates=1), train(True, algo, pack=True, updates=1))


# -- DeepSpeed (a subprocess: its process group and accelerator are per process) -------------------

WORKER = Path(__file__).with_name("ckpt_ds_worker.py")


def _check_ds(out: Path, world: int):
    result = json.loads(out.read_text())
    assert result["world"] == world
    assert result["metrics_equal"], result["metrics_diff"]
    assert result["params_equal"], result["params_diff"]
    assert result["checkpointing"] == [False, True]


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_deepspeed_one_process(stage, tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "result.json"
    run_worker(WORKER, stage, out, timeout=900)
    _check_ds(out, 1)


@pytest.mark.heavy
@pytest.mark.slow
def test_deepspeed_zero3_two_processes(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "result.json"
    run_worker(WORKER, 3, out, processes=2, master_port=29637, timeout=900)
    _check_ds(out, 2)


# -- rltt train ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_three_step_train_logs_the_same_metrics(tmp_path, monkeypatch):
    """Every non-timing value of metrics.jsonl (rollouts, rewards, losses, grad norms, eval) is
    the same; the checkpoint function transformers' switch installs is seen running."""
    import transformers.modeling_utils

    from rltt.cli.main import main
    from rltt.telemetry import read_metrics
    from tests.orchestration.test_local import write_recipe

    calls = []
    checkpoint = transformers.modeling_utils.checkpoint
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint",
                        lambda *args, **kwargs: calls.append(1) or checkpoint(*args, **kwargs))
    runs = []
    for checkpointing in (False, True):
        root = tmp_path / str(checkpointing)
        root.mkdir()
        path = write_recipe(root)
        assert main(["train", str(path), f"learner.activation_checkpointing={str(checkpointing).lower()}"]) == 0
        runs.append([computed(r) for r in read_metrics(root / "run")])
        assert bool(calls) == checkpointing
    assert len(runs[0]) == len(runs[1]) and [r["step"] for r in runs[1] if r["step"] > 0] == [1, 2, 3]
    for without, with_ckpt in zip(*runs):
        assert without == with_ckpt
