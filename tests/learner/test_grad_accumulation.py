"""A 16-bit learner under DeepSpeed accumulates its micro-batch gradients in fp32 at every ZeRO
stage rltt offers (1-3; ZeRO-0 with bf16 is refused), and every DeepSpeed run writes the config it
passed DeepSpeed to RUN_DIR/deepspeed_config.json."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rltt.errors import ConfigError
from rltt.learner import AlgorithmConfig, Learner, LearnerConfig
from rltt.learner.accumulation import BF16_ROUNDING, AccumulationProbe
from rltt.learner.backends import DEEPSPEED_CONFIG_FILE, TorchBackend, deepspeed_config
from tests.subprocess_env import ROOT, worker_env

from .helpers import synthetic_batch, tiny_policy

WORKER = Path(__file__).with_name("ds_accum_worker.py")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_config_accumulates_in_fp32(stage):
    config = deepspeed_config(LearnerConfig(backend="deepspeed", zero_stage=stage, dtype="bf16"), 2, 128)
    assert config["bf16"] == {"enabled": True}
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    # ZeRO-1 all-reduces the fp32 sum once per update: in fp32, or the sum is rounded to bf16
    assert config.get("communication_data_type") == ("fp32" if stage == 1 else None)
    fp32 = deepspeed_config(LearnerConfig(backend="deepspeed", zero_stage=stage), 2, 128)
    assert "bf16" not in fp32 and "data_types" not in fp32 and "communication_data_type" not in fp32


def test_zero0_bf16_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"learner.zero_stage.*bf16.*zero_stage 1, 2 or 3") as err:
        LearnerConfig(backend="deepspeed", zero_stage=0, dtype="bf16")
    assert "\n" not in str(err.value)
    LearnerConfig(backend="deepspeed", zero_stage=0)  # fp32: DeepSpeed accumulates in fp32 anyway
    LearnerConfig(backend="torch", dtype="bf16")


class _ModuleGradBackend:
    """A backend that sums the micro-batch gradients in the module's own ``.grad`` and steps plain
    AdamW on the module (what the torch backend did for a bf16 module before its fp32 masters)."""

    name = "module_grad"

    def __init__(self, module):
        self.module = module
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def backward(self, loss):
        loss.backward()

    def step(self, losses=()):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {}, None


def _linear_update(dtype: torch.dtype, steps: int = 64, backend=TorchBackend):
    """One update of a linear layer over ``steps`` micro-batches of same-size positive gradients,
    under the probe."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(dtype)
    backend = TorchBackend(model, LearnerConfig(lr=1e-3)) if backend is TorchBackend else backend(model)
    with AccumulationProbe(backend) as probe:
        for _ in range(steps):
            backend.backward(model((1 + 0.1 * torch.rand(4, 16)).to(dtype)).float().sum())
        backend.step([])
    assert "step" not in backend.__dict__  # the probe restored the backend's own step
    return probe.result


def test_probe_sees_bf16_accumulation_drift():
    """The probe itself: a bf16 module's .grad sums in bf16 (off by more than one rounding); the torch
    backend's fp32 masters of the same bf16 module and an fp32 module's .grad sum in fp32 (the exact sum
    of the same bf16-sized contributions, to fp32 rounding)."""
    bf16 = _linear_update(torch.bfloat16, backend=_ModuleGradBackend)
    assert bf16.micro_steps == 64 and bf16.tensors == 2 and bf16.grad_dtype == "bfloat16"
    assert bf16.held_dtype == "bfloat16" and not bf16.ok
    assert bf16.error == pytest.approx(bf16.running_sum_error, rel=1e-12) and bf16.error > 4 * BF16_ROUNDING
    masters = _linear_update(torch.bfloat16)
    assert masters.grad_dtype == "bfloat16" and masters.held_dtype == "float32"
    assert masters.ok and masters.error < 1e-6 and masters.running_sum_error == bf16.running_sum_error
    fp32 = _linear_update(torch.float32)
    assert fp32.ok and fp32.error < 1e-6 and fp32.held_dtype == "float32"


def test_probe_follows_a_learner_update():
    learner = Learner(tiny_policy(seed=0), LearnerConfig(micro_batch_size=1), AlgorithmConfig(track_kl=False),
                      batch_size=4, max_len=8)
    with AccumulationProbe(learner.backend) as probe:
        learner.update(synthetic_batch(B=4, seed=1))
    check = probe.result
    assert check.micro_steps == 4 and check.tensors == len(list(learner.model.parameters()))
    assert check.ok and check.error < 1e-6 and check.exact_norm > 0


# -- DeepSpeed (CPU, gloo) ---------------------------------------------------------------------------------
def _check(report: dict, stages: list[int], world: int) -> None:
    assert report["world"] == world
    for stage in stages:
        entry = report["stages"][str(stage)]
        linear = entry["linear"]
        assert linear["micro_steps"] == 64 and linear["held_dtype"] == "float32", (stage, linear)
        # the fp32 sum of the micro-batch gradients (every rank runs the same ones: the average is the sum)
        assert linear["ok"] and linear["error"] < 1e-6 and linear["max_rel_error"] < 1e-6, (stage, linear)
        # where a bf16 running sum of the same gradients is off by more than one bf16 rounding
        assert linear["running_sum_error"] > 4 * BF16_ROUNDING, (stage, linear)
        if "learner" in entry:
            learner = entry["learner"]
            assert learner["micro_steps"] == 16 and learner["held_dtype"] == "float32", (stage, learner)
            assert learner["ok"] and learner["error"] < 1e-6, (stage, learner)
            # sync/changed_frac of the bf16 update (lr 1e-3): what the engines receive, counted independently
            # (exactly; the metric samples at most 256 elements a tensor: within its sampling error)
            assert learner["changed_counted"] > 0.9, (stage, learner)
            assert abs(learner["changed_frac"] - learner["changed_counted"]) <= 0.05, (stage, learner)


@pytest.mark.heavy
@pytest.mark.slow
def test_deepspeed_bf16_accumulates_in_fp32_one_process(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(WORKER), "1,2,3", str(out)], env=worker_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    _check(report, [1, 2, 3], 1)
    assert [report["stages"][s]["optimizer"] for s in "123"] == \
        ["BF16_Optimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"]


@pytest.mark.heavy
@pytest.mark.slow
def test_deepspeed_bf16_accumulates_in_fp32_two_processes(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29617",
           str(WORKER), "1,2", str(out)]
    proc = subprocess.run(cmd, env=worker_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads(out.read_text()), [1, 2], 2)


@pytest.mark.heavy
@pytest.mark.slow
def test_bf16_deepspeed_train_writes_its_config(tmp_path):
    """``rltt train`` with a bf16 DeepSpeed learner (the quickstart tokenizer's tiny model) writes the
    exact config it passed DeepSpeed, with fp32 gradient accumulation."""
    pytest.importorskip("deepspeed")
    from rltt.orchestration.train_recipe import load_train_recipe
    from tests.orchestration.helpers import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "policy")
    recipe = {
        "model": {"path": str(ckpt), "dtype": "bf16"},
        "data": {"source": "synthetic:easy", "eval_size": 2},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}],
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "algorithm": {"kl_coef": 0.0, "track_kl": False},
        "learner": {"backend": "deepspeed", "zero_stage": 2, "dtype": "bf16", "lr": 1e-3, "micro_batch_size": 1},
        "train": {"steps": 1, "eval_every": 0},
        "logging": {"run_dir": str(tmp_path / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 0, "save_final": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = subprocess.run([sys.executable, "-m", "rltt.cli.main", "train", str(path)], env=worker_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads((tmp_path / "run" / DEEPSPEED_CONFIG_FILE).read_text())
    r = load_train_recipe(path)
    rows = r.batch_size  # one rank: the whole step's batch, in micro-batches of 1
    from rltt.planning.shapes import model_shape

    parameters = model_shape(json.loads((ckpt / "config.json").read_text())).parameters  # the plan's P
    assert written == deepspeed_config(r.learner, 1, rows, parameters=parameters)
    assert written["data_types"] == {"grad_accum_dtype": "fp32"} and written["bf16"] == {"enabled": True}
    assert written["gradient_accumulation_steps"] == 4


def test_plan_counts_zero1_full_fp32_gradient_buffer():
    """Two ranks, bf16: ZeRO-1's BF16 optimizer holds a full fp32 gradient buffer on every rank (4 bytes
    per parameter) from start-up; ZeRO-2 a partition of it (4 / 2) in the learner phase."""
    from dataclasses import replace

    from rltt.model import LoopConfig
    from rltt.planning.footprint import learner as learner_terms
    from rltt.planning.footprint import resident
    from rltt.planning.run_settings import RunSettings
    from rltt.planning.shapes import ModelShape

    shape = ModelShape.of(LoopConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_loops=2))
    s = RunSettings(device="cuda", gpus=2, model_dtype="bf16", learner_dtype="bf16", backend="deepspeed",
                    zero_stage=1, micro_batch_size=8, checkpointing=False, needs_reference=False, kl_coef=0.0,
                    engine="native", vllm_utilization=0.5, vllm_kv_gb=1.0, prompts_per_step=4, group_size=8,
                    prompt_tokens=100, completion_tokens=50, top_p=1.0, top_k=0, chunk_rows="auto")
    P = shape.parameters
    assert resident(shape, s, 80 << 30)["grad_buffers"] == 4 * P
    assert learner_terms(shape, replace(s, zero_stage=2))["gradients"] == 4 * -(-P // 2)
    # an fp32 model keeps ZeRO-1's gradient partition (DeepSpeed's ZeRO optimizer, no BF16 optimizer)
    fp32 = replace(s, model_dtype="fp32", learner_dtype="fp32")
    assert resident(shape, fp32, 80 << 30)["grad_buffers"] == 0
    assert learner_terms(shape, fp32)["step_workspace"] == learner_terms(shape, replace(fp32, zero_stage=2))[
        "step_workspace"]
