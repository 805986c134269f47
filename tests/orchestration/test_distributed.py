"""Data-parallel `rltt train` (2 processes under torchrun, DeepSpeed ZeRO-2 on CPU/gloo): each rank
samples its share of the step's prompts, metrics describe the whole step and are written once,
checkpoints resume on every rank; a world size that does not divide prompts_per_step is refused."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rltt.cli.main import main
from rltt.errors import ConfigError
from rltt.orchestration.trainer import Trainer
from rltt.orchestration.prompt_stream import PromptStream
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.rollout.seeds import rollout_seed
from rltt.telemetry import read_metrics
from tests.subprocess_env import worker_env

from .helpers import tiny_checkpoint
from .test_local import REWARD

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.heavy, pytest.mark.slow]

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = WORKER.parents[2]
P, G, STEPS = 4, 2, 2  # prompts per step, group size: 2 prompts (4 sequences) per rank


def _env():
    return worker_env(RAY_AUTH_MODE="disabled")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), *args]
    return subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)


def write_recipe(tmp_path: Path) -> Path:
    ckpt = tiny_checkpoint(tmp_path / "policy")
    (tmp_path / "my_rewards.py").write_text(REWARD)
    recipe = {
        "model": {"path": str(ckpt)},
        "data": {"source": "synthetic:easy", "eval_size": 4},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}, {"fn": "my_rewards.py:diversity", "weight": 0.5}],
        "rollout": {"prompts_per_step": P, "group_size": G, "max_new_tokens": 4},
        "algorithm": {"kl_coef": 0.0},
        "learner": {"backend": "deepspeed", "zero_stage": 2, "lr": 1e-2, "micro_batch_size": 2},
        "train": {"steps": STEPS, "eval_every": STEPS},
        "logging": {"run_dir": str(tmp_path / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 0, "save_final": True},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """One 2-rank, 2-step run by the worker: (recipe path, run dir, [rank 0 record, rank 1 record])."""
    tmp = tmp_path_factory.mktemp("dp")
    recipe = write_recipe(tmp)
    proc = torchrun(str(WORKER), str(recipe), str(tmp))
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    return recipe, tmp / "run", records


def test_two_ranks_train_and_log_the_whole_step_once(two_rank_run):
    _, run_dir, records = two_rank_run
    assert [r["world"] for r in records] == [2, 2]
    assert [r["batch_size"] for r in records] == [P * G // 2] * 2  # the learner's per-rank batch
    assert all(r["changed"] for r in records)
    assert records[0]["checksum"] == pytest.approx(records[1]["checksum"], rel=1e-9)  # ranks stay in sync
    assert [r["has_logger"] for r in records] == [True, False]
    lines = read_metrics(run_dir)
    assert [r["step"] for r in lines] == [0, 1, 2]  # each step once: rank 0 alone writes
    assert "eval/solve_rate" in lines[0] and "eval/solve_rate" in lines[2]
    for step, line in enumerate(lines[1:]):
        assert line["rollout/sequences"] == P * G
        everyone = records[0]["rewards"][step] + records[1]["rewards"][step]
        assert len(everyone) == P * G
        assert line["reward/mean"] == pytest.approx(sum(everyone) / len(everyone), rel=1e-6)
        assert "loss/total" in line and "grad_norm/total" in line
    ckpt = run_dir / "checkpoints" / f"step-{STEPS:07d}"
    shards = sorted(p.name for p in (ckpt / "deepspeed").rglob("zero_pp_rank_*"))
    assert len(shards) == 2 and (ckpt / "rl_state.pt").is_file()
    assert not list((run_dir / "checkpoints").glob(".*"))  # no staging / temporary directory left


def test_ranks_take_disjoint_contiguous_shares_with_their_own_seeds(two_rank_run):
    recipe, _, records = two_rank_run
    trainer_recipe = load_train_recipe(recipe)
    stream = PromptStream(trainer_recipe.data.source, lambda text: [0], trainer_recipe.data.prompt_template)
    for step in range(STEPS):
        expected = [t.id for t in stream.next(P)]  # the global list every rank draws
        assert records[0]["task_ids"][step] == expected[: P // 2]
        assert records[1]["task_ids"][step] == expected[P // 2:]
        # each prompt's seed is keyed by its global index, whichever rank samples it
        seeds = [rollout_seed(trainer_recipe.seed, step + 1, 0, i) for i in range(P)]
        assert records[0]["seeds"][step] + records[1]["seeds"][step] == seeds and len(set(seeds)) == P


def test_reduce_ranks_over_two_processes(two_rank_run):
    _, _, records = two_rank_run
    expected = {"n": 3, "x": 0.75, "hi": 1, "lo": 0, "rows": [0, 0, 1, 1], "t": [0.0, 1.0], "ids": {"r0": 0, "r1": 1}}
    assert records[0]["reduced"] == records[1]["reduced"] == expected


def test_resume_from_a_two_rank_checkpoint_continues_exactly(two_rank_run, tmp_path):
    recipe, run_dir, _ = two_rank_run
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    proc = torchrun("-m", "rltt.cli.main", "train", str(recipe), f"logging.run_dir={resumed}",
                    f"train.steps={STEPS + 1}", "train.eval_every=0", "--resume")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count(f"{STEPS + 1} steps; run:") == 1  # rank 0 reports
    lines = [r for r in read_metrics(resumed) if r["step"] > 0]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 2))

    straight = tmp_path / "straight"
    proc = torchrun("-m", "rltt.cli.main", "train", str(recipe), f"logging.run_dir={straight}",
                    f"train.steps={STEPS + 1}", "train.eval_every=0")
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = read_metrics(straight)[-1]
    for key in ("reward/mean", "length/mean", "loss/total", "grad_norm/total"):
        assert lines[-1][key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key


def test_dynamic_sampling_refills_keep_the_ranks_streams_equal(tmp_path):
    recipe = write_recipe(tmp_path)
    proc = torchrun(str(WORKER), str(recipe), str(tmp_path), "algorithm.dynamic_sampling=true",
                    "algorithm.max_refills=2", "train.eval_every=0", "checkpoint.save_final=false")
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert records[0]["stream_position"] == records[1]["stream_position"] >= STEPS * P
    assert all(len(ids) == P // 2 for r in records for ids in r["task_ids"])  # each rank's share, refilled
    assert records[0]["checksum"] == pytest.approx(records[1]["checksum"], rel=1e-9)
    lines = read_metrics(tmp_path / "run")
    assert [r["step"] for r in lines] == [1, 2] and all("rollout/refills" in r for r in lines)
    refills = sum(r["rollout/refills"] for r in lines)
    assert records[0]["stream_position"] >= STEPS * P + refills  # every refill drew from the shared stream


def test_world_size_must_divide_prompts_per_step(tmp_path, monkeypatch, capsys):
    path = write_recipe(tmp_path)
    capsys.readouterr()  # the tiny checkpoint's save progress
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"rollout\.prompts_per_step: 3 .*world size 2"):
        Trainer(load_train_recipe(path, ["rollout.prompts_per_step=3"]), recipe_root=tmp_path)
    assert not (tmp_path / "run").exists()  # refused before any work
    assert main(["train", str(path), "rollout.prompts_per_step=3"]) == 2
    err = capsys.readouterr().err
    assert "rollout.prompts_per_step" in err and "2" in err and len(err.strip().splitlines()) == 1
    assert main(["train", str(path), "learner.backend=torch"]) == 2  # the torch backend is one process
    err = capsys.readouterr().err
    assert "learner.backend" in err and "WORLD_SIZE=2" in err and len(err.strip().splitlines()) == 1


def test_zero3_checkpoints_hold_full_weights_and_resume(tmp_path):
    """ZeRO-3 partitions the parameters: the checkpoint's model files are gathered (loadable on
    their own) and a resumed run continues as an uninterrupted one."""
    from rltt.orchestration.policy import load_policy

    recipe = write_recipe(tmp_path)
    zero3 = ["learner.zero_stage=3", "train.eval_every=0"]
    run_dir, straight = tmp_path / "z3", tmp_path / "z3-straight"
    proc = torchrun("-m", "rltt.cli.main", "train", str(recipe), f"logging.run_dir={run_dir}", *zero3)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = run_dir / "checkpoints" / f"step-{STEPS:07d}"
    model, _ = load_policy(ckpt, "fp32", "cpu")
    reference, _ = load_policy(tiny_checkpoint(tmp_path / "fresh"), "fp32", "cpu")
    for name, tensor in reference.state_dict().items():
        trained = model.state_dict()[name]
        assert trained.shape == tensor.shape, name
    assert any(not torch.equal(model.state_dict()[k], v) for k, v in reference.state_dict().items())

    proc = torchrun("-m", "rltt.cli.main", "train", str(recipe), f"logging.run_dir={run_dir}", *zero3,
                    f"train.steps={STEPS + 1}", "--resume")
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = torchrun("-m", "rltt.cli.main", "train", str(recipe), f"logging.run_dir={straight}", *zero3,
                    f"train.steps={STEPS + 1}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed, uninterrupted = read_metrics(run_dir)[-1], read_metrics(straight)[-1]
    assert resumed["step"] == uninterrupted["step"] == STEPS + 1
    for key in ("reward/mean", "length/mean", "loss/total", "grad_norm/total"):
        assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-7), key


def test_two_ranks_sample_what_one_process_samples(two_rank_run, tmp_path):
    """Per-prompt seeds keyed by the global prompt index: the first step's rows of the two ranks,
    in rank order, are one process's rows (same weights before any update)."""
    recipe, _, records = two_rank_run
    one = Trainer(load_train_recipe(recipe, ["learner.backend=torch", f"logging.run_dir={tmp_path / 'one'}"]),
                       recipe_root=recipe.parent)
    groups, _ = one.training.rollout(1)
    assert groups.task_ids == records[0]["task_ids"][0] + records[1]["task_ids"][0]
    assert groups.prompt_seeds == records[0]["seeds"][0] + records[1]["seeds"][0]
    assert groups.rewards.tolist() == records[0]["rewards"][0] + records[1]["rewards"][0]
