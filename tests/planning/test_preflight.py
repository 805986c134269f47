"""What `rltt train` states before step 1: the memory plan in brief and the cost of the held-out
evaluation that runs before it (GSM8K's test split on the GPU recipes: 1,319 prompts × 512 tokens)."""

from pathlib import Path

import yaml

from rltt.cli.main import main
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.planning.preflight import eval_cost, eval_line
from tests.orchestration.helpers import tiny_checkpoint

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_gsm8k_eval_before_step_1_names_its_cost():
    recipe = load_train_recipe(RECIPES / "gsm8k.yaml", ["model.path=quickstart"])
    cost = eval_cost(recipe, 1319, loops=4)  # GSM8K's test split, Ouro's T = 4
    assert (cost.prompts, cost.samples, cost.max_tokens, cost.step_rows) == (1319, 1, 512, 512)
    assert cost.tokens == 1319 * 512 and cost.block_passes == 4 * 1319 * 512
    line = eval_line(cost, recipe.train.eval_every)
    assert "1,319 prompts × 1 sample(s) × up to 512 new tokens = 675,328 tokens" in line
    assert "2,701,312 block passes" in line and "2.6× one training step's rollout (512 rows)" in line
    assert "data.eval_size" in line and "then every 25 steps" in line and "\n" not in line
    thinking = load_train_recipe(RECIPES / "gsm8k.yaml", ["model.path=quickstart", "train.eval_samples=4"])
    assert eval_cost(thinking, 1319, 4).tokens == 4 * 1319 * 512


def test_train_prints_the_plan_and_the_eval_cost_before_step_1(tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "policy", num_loops=3)
    recipe = {
        "model": {"path": str(ckpt), "device": "cpu"},
        "data": {"source": "synthetic:easy", "eval_size": 5},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6},
        "learner": {"micro_batch_size": 2},
        "train": {"steps": 1, "eval_every": 1},
        "logging": {"run_dir": str(tmp_path / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 0, "save_final": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rltt train: ")]
    plan = next(line for line in lines if "memory plan:" in line)
    assert "GiB usable" in plan and "train.memory_headroom=0.1" in plan and "allocated bytes" in plan
    evaluation = next(line for line in lines if "held-out evaluation before step 1" in line)
    assert "5 prompts × 1 sample(s) × up to 6 new tokens = 30 tokens, up to 90 block passes" in evaluation
    assert "1.2× one training step's rollout (4 rows)" in evaluation
    assert lines.index(evaluation) > lines.index(plan)
