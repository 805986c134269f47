"""The RL loop's non-finite guard: ``learner.lr=1e30`` skips the steps whose loss goes NaN, writes
their alarms, and after ``train.max_consecutive_skips`` stops with one line (exit 2) before that
step's checkpoint; every checkpoint holds finite weights; the count survives ``--resume``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rltt.errors import ConfigError
from rltt.orchestration.trainer import Trainer
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.runtime.checkpoint import checkpoint_dir, latest_checkpoint, list_checkpoints
from rltt.telemetry import read_metrics
from rltt.telemetry import schema as m

from .helpers import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]

REWARDS = """
def varied(completion, answer, **kw):
    return float(len(completion) % 2)  # groups are rarely uniform: the loss has a gradient


def huge(completion, answer, **kw):
    return 1e39  # finite in float64, inf in float32
"""


def _recipe(root: Path, rewards, **sections) -> Path:
    ckpt = tiny_checkpoint(root / "policy")
    (root / "my_rewards.py").write_text(REWARDS)
    recipe = {
        "model": {"path": str(ckpt)},
        "data": {"source": "synthetic:easy", "eval_size": 4},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}] + [{"fn": f"my_rewards.py:{fn}"} for fn in rewards],
        "rollout": {"prompts_per_step": 2, "group_size": 3, "max_new_tokens": 6},
        "learner": {"lr": 1e-3, "micro_batch_size": 3},
        "train": {"steps": 8, "eval_every": 0},
        "logging": {"run_dir": str(root / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 1, "keep_last": 0},
    }
    for section, values in sections.items():
        recipe[section].update(values)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _train(path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "rltt.cli.main", "train", str(path), *extra], cwd=path.parent,
                          env=env, capture_output=True, text=True, timeout=900)


def _alarm_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "alarms.jsonl").read_text().splitlines()]


def _weights(step_dir: Path) -> dict:
    return load_file(str(step_dir / "model.safetensors"))


def _error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("rltt train: error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_lr_1e30_skips_then_stops_with_one_line_before_the_checkpoint(tmp_path):
    path = _recipe(tmp_path, ["varied"], learner={"lr": 1e30})
    run = tmp_path / "run"
    proc = _train(path)
    assert proc.returncode == 2
    line = _error_line(proc.stderr)
    assert "consecutive non-finite steps" in line and "loss is nan" in line
    stopped = int(line.split("error: step ")[1].split(":")[0])
    skipped = _alarm_steps(run)
    assert skipped[-3:] == [stopped - 2, stopped - 1, stopped]  # K = 3 in a row (train.max_consecutive_skips)
    records = {r["step"]: r for r in read_metrics(run)}
    assert max(records) == stopped  # the stopping step is logged ...
    assert records[stopped][m.GUARD_SKIPPED_STEPS] == len(skipped)
    assert all(m.TIME_WEIGHT_SYNC not in records[s] for s in skipped)  # a skipped step syncs nothing
    steps = [s for s, _ in list_checkpoints(run, "rl_state.pt")]
    assert max(steps) == stopped - 1  # ... but writes no checkpoint: the newest is the last good one
    assert latest_checkpoint(run, "rl_state.pt") == checkpoint_dir(run, stopped - 1)
    weights = {s: _weights(checkpoint_dir(run, s)) for s in steps}
    assert all(torch.isfinite(v).all() for w in weights.values() for v in w.values())
    last_good = skipped[-3] - 1  # the skipped steps changed no weight, bit for bit
    for s in skipped[-3:-1]:
        assert all(torch.equal(weights[s][k], weights[last_good][k]) for k in weights[s])

    # --resume: the guard's count comes back with the checkpoint (2 in a row), so the redone
    # stopping step stops the run again at once; its alarm is not written twice
    proc = _train(path, "--resume")
    assert proc.returncode == 2
    assert f"step {stopped}: stopped after 3 consecutive" in _error_line(proc.stderr)
    assert _alarm_steps(run) == skipped
    assert [r["step"] for r in read_metrics(run)] == list(range(0 if 0 in records else 1, stopped + 1))


@pytest.mark.slow
def test_a_reward_of_1e39_scores_zero_and_the_run_stays_finite(tmp_path):
    path = _recipe(tmp_path, ["varied", "huge"], train={"steps": 2}, checkpoint={"every": 2})
    run = tmp_path / "run"
    Trainer(load_train_recipe(path), recipe_root=tmp_path).run()
    rows = [r for r in read_metrics(run) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/errors/my_rewards.huge"] == r[m.ROLLOUT_SEQUENCES]  # every call: not a float32
        assert r["reward/my_rewards.huge"] == 0.0
        assert r[m.GUARD_SKIPPED_STEPS] == 0
        assert all(v == v and abs(v) != float("inf") for v in r.values() if isinstance(v, float))
    assert not (run / "alarms.jsonl").exists()
    weights = _weights(checkpoint_dir(run, 2))
    assert all(torch.isfinite(v).all() for v in weights.values())


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0"])
def test_a_non_finite_or_zero_learning_rate_is_refused_at_load(tmp_path, value):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": str(tmp_path)}, "data": {"source": "synthetic:easy"}}))
    with pytest.raises(ConfigError, match=r"learner\.lr") as info:
        load_train_recipe(path, [f"learner.lr={value}"])
    assert "\n" not in str(info.value)
