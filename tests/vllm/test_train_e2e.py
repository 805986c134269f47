"""`rltt train rollout.engine=vllm`: 5 RL steps with vLLM rollouts, the learner replaying the recorded
exits (sampler-learner mismatch within 1e-4 in fp32, importance ratio 1 at the rollout weights).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.orchestration.helpers import tiny_checkpoint
from tests.orchestration.test_local import REWARD
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


@pytest.mark.parametrize("serving", ["adapters", "merged"])
def test_lora_steps_with_vllm_rollouts(tmp_path, serving, monkeypatch):
    """A LoRA run on vLLM rollouts: served through vLLM's LoRA (the adapters alone sent each update)
    or merged into the base (every weight sent). After each update vLLM samples the updated policy:
    the learner's log-probs at the rollout weights equal the sampler's within 1e-4 — the adapters
    move fast (lr 1e-2), so a stale or missing adapter would show in the mismatch."""
    from rltt.orchestration.trainer import Trainer
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.model.adapters import is_adapter
    from rltt.telemetry import read_metrics
    from rltt.vllm.vllm_engine import VllmEngine

    sent = []
    load = VllmEngine.load_weights

    def recording(self, version, tensors):
        sent.append(sorted(tensors))
        return load(self, version, tensors)

    monkeypatch.setattr(VllmEngine, "load_weights", recording)
    (tmp_path / "my_rewards.py").write_text(REWARD)  # varies across a random policy's samples: real updates
    recipe = {
        "model": {"path": str(checkpoint(tmp_path / "policy"))},
        "data": {"source": "synthetic:easy", "eval_size": 8},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}, {"fn": "my_rewards.py:diversity", "weight": 0.5}],
        "rollout": {"engine": "vllm", "schedule": "dense", "prompts_per_step": 2, "group_size": 3,
                    "max_new_tokens": 6, "vllm": {"kv_cache_gb": 1, "max_model_len": 512, "max_num_seqs": 16,
                                                  "lora": serving}},
        "learner": {"lr": 1e-2, "micro_batch_size": 3, "lora": {"rank": 4, "alpha": 8.0}},
        "train": {"steps": 4, "eval_every": 0},
        "logging": {"run_dir": str(tmp_path / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 0, "save_final": serving == "adapters"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = Trainer(load_train_recipe(path), recipe_root=tmp_path).run()
    assert result.steps == 4
    assert len(sent) >= 3  # an update after every step but the last
    assert all(all(is_adapter(k) for k in names) == (serving == "adapters") for names in sent)
    steps = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert len(steps) == 4 and steps[-1]["lora/update_norm/q_proj"] > 0
    for record in steps:
        assert record["mismatch/max_abs"] <= 1e-4
        assert record["policy/ratio_mean"] == 1.0
    if serving == "adapters":  # the LoRA checkpoint evaluates on vLLM (its adapters merged for the engine)
        from rltt.cli.main import main

        out = tmp_path / "eval.json"
        final = tmp_path / "run" / "checkpoints" / "step-0000004"
        assert main(["eval", str(path), "--model", str(final), "--samples", "1", "--out", str(out)]) == 0
        assert out.exists()
