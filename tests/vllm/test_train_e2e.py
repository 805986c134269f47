"""`rltt train rollout.engine=vllm`: 5 RL steps with vLLM rollouts, the learner replaying the recorded
exits (sampler-learner mismatch within 1e-4 in fp32, importance ratio 1 at the rollout weights).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.orchestration.helpers import tiny_checkpoint
from tests.vllm.helpers import needs_vllm

pytestmark = [pytest.mark.heavy, pytest.mark.slow, needs_vllm]


def checkpoint(path: Path) -> Path:
    return tiny_checkpoint(path, hidden_size=128, intermediate_size=192, head_dim=64, max_position_embeddings=512)


def test_five_steps_with_vllm_rollouts(tmp_path):
    from rltt.orchestration.trainer import Trainer
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.telemetry import read_metrics

    recipe = {
        "model": {"path": str(checkpoint(tmp_path / "policy"))},
        "data": {"source": "synthetic:easy", "eval_size": 8},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}],
        "rollout": {"engine": "vllm", "schedule": "dense", "prompts_per_step": 2, "group_size": 3,
                    "max_new_tokens": 6, "vllm": {"kv_cache_gb": 1, "max_model_len": 512, "max_num_seqs": 16}},
        "learner": {"lr": 1e-3, "micro_batch_size": 3},
        "train": {"steps": 5, "eval_every": 0},
        "logging": {"run_dir": str(tmp_path / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 0, "save_final": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = Trainer(load_train_recipe(path), recipe_root=Path.cwd()).run()
    assert result.steps == 5
    steps = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert len(steps) == 5
    for record in steps:
        assert record["mismatch/max_abs"] <= 1e-4
        # one update per batch at the rollout weights: the hybrid log-prob makes the ratio exactly 1
        assert record["policy/ratio_mean"] == 1.0
        assert record["policy/ratio_max"] == 1.0 and record["policy/ratio_min"] == 1.0
