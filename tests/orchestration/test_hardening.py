"""Faults in `rltt train`: bad rewards, damaged or crafted checkpoints, a run_dir holding the recipe."""

import json
import os

import pytest
import torch
import yaml

from rltt.errors import RlttError
from rltt.orchestration.trainer import Trainer
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.runtime.checkpoint import checkpoint_dir, list_checkpoints
from rltt.telemetry import read_metrics

from .helpers import tiny_checkpoint

REWARD = """
import sys

def picky(completion, answer, **kw):
    if len(completion) % 3 == 0:
        sys.exit(3)
    if len(completion) % 3 == 1:
        raise ValueError(f"cannot score {kw['prompt_id']}")
    return 0.5
"""


def _recipe(root, **sections):
    ckpt = tiny_checkpoint(root / "policy")
    (root / "my_rewards.py").write_text(REWARD)
    recipe = {
        "model": {"path": str(ckpt)},
        "data": {"source": "synthetic:easy", "eval_size": 4},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}, {"fn": "my_rewards.py:picky", "timeout_s": 2.0}],
        "rollout": {"prompts_per_step": 2, "group_size": 3, "max_new_tokens": 6},
        "learner": {"lr": 1e-3, "micro_batch_size": 3},
        "train": {"steps": 3, "eval_every": 3},
        "logging": {"run_dir": str(root), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 2},
    }
    for section, values in sections.items():
        recipe[section].update(values)
    path = root / "recipe.yaml"
    path.write_text("# my notes: keep these\n" + yaml.safe_dump(recipe))
    return path


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.slow
def test_bad_rewards_damaged_and_crafted_checkpoints(tmp_path, capsys):
    path = _recipe(tmp_path)  # logging.run_dir is the folder holding the recipe
    original = path.read_bytes()
    Trainer(load_train_recipe(path), recipe_root=tmp_path).run()
    assert path.read_bytes() == original  # the resolved recipe went beside it
    assert (tmp_path / "recipe.resolved.yaml").is_file()

    # a reward that raises or calls sys.exit(3) on some samples: scored 0, counted, written; the run goes on
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["reward/errors"] == r["reward/errors/my_rewards.picky"] for r in rows)
    assert sum(r["reward/errors"] for r in rows) > 0
    errors = [json.loads(line) for line in (tmp_path / "reward_errors.jsonl").read_text().splitlines()]
    kinds = {e["kind"] for e in errors}
    assert kinds <= {"ValueError", "SystemExit"} and kinds
    for e in errors:
        assert e["function"] == "my_rewards.picky" and e["prompt_id"] and e["step"] in (0, 1, 2, 3, None)
        assert e["message"] in ("SystemExit: 3", f"ValueError: cannot score {e['prompt_id']}")

    # the latest checkpoint lost its weights: --resume falls back to step 2 and redoes step 3
    assert [s for s, _ in list_checkpoints(tmp_path, "rl_state.pt")] == [2, 3]
    (checkpoint_dir(tmp_path, 3) / "model.safetensors").unlink()
    Trainer(load_train_recipe(path), resume=True, recipe_root=tmp_path).run()
    assert "skipping checkpoint" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]

    # crafted pickles as rl_state.pt / optimizer.pt: refused with one line, nothing runs
    for name in ("rl_state.pt", "optimizer.pt"):
        marker = tmp_path / f"pwned-{name}"
        target = checkpoint_dir(tmp_path, 3) / name
        saved = target.read_bytes()
        torch.save({"step": 3, "prompts": {"position": 0}, "optimizer": Exploit(marker)}, target)
        from rltt.runtime.checkpoint import write_manifest

        write_manifest(checkpoint_dir(tmp_path, 3))
        with pytest.raises(RlttError, match=f"refusing to load .*{name}") as info:
            Trainer(load_train_recipe(path), resume=True, recipe_root=tmp_path)
        assert "\n" not in str(info.value) and not marker.exists()
        target.write_bytes(saved)
        write_manifest(checkpoint_dir(tmp_path, 3))


@pytest.mark.slow
def test_resume_before_the_first_checkpoint_writes_step0_once(tmp_path):
    path = _recipe(tmp_path, train={"steps": 1, "eval_every": 1}, checkpoint={"every": 0, "save_final": False},
                   logging={"run_dir": str(tmp_path / "run")})
    Trainer(load_train_recipe(path), recipe_root=tmp_path).run()  # ends like a kill: no checkpoint
    Trainer(load_train_recipe(path), resume=True, recipe_root=tmp_path).run()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]


def test_resume_on_a_directory_without_a_run(tmp_path):
    path = _recipe(tmp_path, logging={"run_dir": str(tmp_path / "missing")})
    with pytest.raises(RlttError, match="no run in logging.run_dir"):
        Trainer(load_train_recipe(path), resume=True, recipe_root=tmp_path)
