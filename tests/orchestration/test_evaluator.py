"""The one evaluation: `rltt eval` of a run's checkpoint reproduces what the run logged."""

import json

import yaml

from rltt.cli.main import main
from rltt.orchestration.policy import RecipePolicy
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.orchestration.trainer import Trainer
from rltt.planning.memory_plan import plan_here
from rltt.telemetry import read_metrics
from rltt.telemetry import schema as m

from .helpers import tiny_checkpoint

REWARD = """
def odd(completion, answer, **kw):
    # solves about half of a random policy's samples: a solve rate that depends on every draw
    return float(len(set(completion)) % 2)
"""


def write_recipe(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARD)
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_checkpoint(tmp_path / "policy"))},
        "data": {"source": "synthetic:easy", "eval_size": 6},
        "rewards": [{"fn": "my_rewards.py:odd"}],
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6, "top_k": 20,
                    "stop_strings": ["="]},
        "learner": {"lr": 1e-2, "micro_batch_size": 4},
        "train": {"steps": 1, "eval_every": 1, "eval_samples": 3, "eval_exit_policy": "threshold:0.4"},
        "logging": {"run_dir": str(tmp_path / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 1},
    }))
    return recipe_path


def test_eval_and_curate_sample_in_the_chunks_train_plans(tmp_path):
    """``rollout.chunk_rows: auto`` is the memory plan's rows for `rltt eval` and `rltt curate` too."""
    recipe = load_train_recipe(write_recipe(tmp_path))
    rows = plan_here(recipe).rollout_rows_per_chunk
    assert recipe.rollout.chunk_rows == "auto" and isinstance(rows, int) and rows >= 1
    with RecipePolicy.load(recipe, tmp_path) as policy:
        assert policy.engine.chunk_rows == rows
    with RecipePolicy.load(load_train_recipe(write_recipe(tmp_path), ["rollout.chunk_rows=2"]), tmp_path) as policy:
        assert policy.engine.chunk_rows == 2


def test_rltt_eval_of_a_checkpoint_reproduces_the_logged_eval(tmp_path, capsys):
    recipe_path = write_recipe(tmp_path)
    assert Trainer(load_train_recipe(recipe_path), recipe_root=tmp_path).run().steps == 1
    capsys.readouterr()
    logged = [r for r in read_metrics(tmp_path / "run") if m.EVAL_SOLVE_RATE in r]
    assert [r["step"] for r in logged] == [0, 1]
    assert logged[0][m.EVAL_SOLVE_RATE] != logged[1][m.EVAL_SOLVE_RATE] or \
        logged[0][m.EVAL_COMPUTE_MEAN_EXIT] != logged[1][m.EVAL_COMPUTE_MEAN_EXIT]  # training moved the policy
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000001"
    for model, record in ((None, logged[0]), (str(checkpoint), logged[1])):
        assert main(["eval", str(recipe_path), "--json", "--bootstrap", "20",
                     *(["--model", model] if model else [])]) == 0
        obj = json.loads(capsys.readouterr().out)
        assert 0 < obj["solve_rate"] < 1
        assert obj["solve_rate"] == record[m.EVAL_SOLVE_RATE]
        assert obj["reward_mean"] == record[m.EVAL_REWARD_MEAN]
        assert obj["mean_exit_step"] == record[m.EVAL_COMPUTE_MEAN_EXIT]
        assert obj["passes_per_token"] == record[m.EVAL_COMPUTE_PASSES_PER_TOKEN]
        assert obj["exit_policy"] == "threshold:0.4"


def test_the_evaluator_returns_counts_and_rltt_eval_reads_them():
    """Per-task (samples, solved) counts are what the evaluation holds; the rates are computed from
    them, and the statistics' `ProblemCounts` take them as they are (nothing rebuilt from a rate)."""
    from rltt.orchestration.evaluator import EvalResult

    result = EvalResult(solved=3, samples=9, reward_sum=3.0, task_counts={"a": (3, 1), "b": (3, 2), "c": (3, 0)},
                        exit_step_sum=0.0, tokens=0)
    assert result.per_task == {"a": 1 / 3, "b": 2 / 3, "c": 0.0}
    counts = result.counts("run")
    assert counts.ids == ["a", "b", "c"] and counts.n.tolist() == [3, 3, 3] and counts.c.tolist() == [1, 2, 0]
    assert counts.origin == "run"
