"""`rltt train` end to end on a tiny model: metrics, parameter change, resume, bad recipes."""


import pytest
import torch
import yaml

from rltt.cli.main import main
from rltt.orchestration.trainer import Trainer
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.telemetry import read_metrics

from .helpers import tiny_checkpoint

EXPECTED_KEYS = ["reward/mean", "reward/std", "reward/gsm8k.strict", "reward/my_rewards.diversity", "reward/errors", "solve_rate",
                 "groups/uniform_frac", "kl/ref", "loss/policy", "loss/total", "policy/clip_frac",
                 "policy/ratio_mean", "grad_norm/total", "grad_norm/layer/0", "grad_norm/group/block",
                 "entropy/loop_1", "entropy/loop_3", "exit/p_1", "exit/p_3", "exit/mean_step", "exit/collapse",
                 "mismatch/max_abs", "mismatch/k3", "length/mean", "length/trunc_frac", "time/rollout",
                 "time/learner", "time/weight_sync", "throughput/tokens_per_s", "memory/peak_gb", "lr"]


REWARD = """
def diversity(completion, answer, **kw):
    # varies across a random policy's samples, so groups are not uniform
    return len(set(completion)) / 10
"""


def write_recipe(tmp_path, **overrides):
    ckpt = tiny_checkpoint(tmp_path / "policy")
    (tmp_path / "my_rewards.py").write_text(REWARD)
    recipe = {
        "model": {"path": str(ckpt)},
        "data": {"source": "synthetic:easy", "eval_size": 8},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}, {"fn": "my_rewards.py:diversity", "weight": 0.5}],
        "rollout": {"prompts_per_step": 2, "group_size": 3, "max_new_tokens": 6},
        "algorithm": {"kl_coef": 0.01},
        "learner": {"lr": 1e-3, "micro_batch_size": 3},
        "train": {"steps": 3, "eval_every": 3},
        "logging": {"run_dir": str(tmp_path / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 2},
    }
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        recipe[section][field] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_three_steps_change_parameters_and_write_every_metric(tmp_path, monkeypatch):
    import rltt.orchestration.step as step_module

    resets = []  # memory/peak_gb is each step's own peak: the CUDA peak restarts after every step's record
    monkeypatch.setattr(step_module, "reset_peak_memory", lambda *a: resets.append(a))
    path = write_recipe(tmp_path)
    trainer = Trainer(load_train_recipe(path), recipe_root=tmp_path)
    before = {k: v.clone() for k, v in trainer.learner_model().state_dict().items()}
    result = trainer.run()
    assert result.steps == 3
    assert len(resets) == 3
    after = trainer.learner_model().state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    records = read_metrics(tmp_path / "run")
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in EXPECTED_KEYS:
        assert all(key in r for r in steps), key
    assert "eval/solve_rate" in records[0] and "eval/solve_rate" in steps[-1]
    assert (tmp_path / "run" / "checkpoints" / "step-0000002").is_dir()
    assert (tmp_path / "run" / "checkpoints" / "step-0000003").is_dir()


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = write_recipe(tmp_path / "a")
    Trainer(load_train_recipe(full), recipe_root=tmp_path / "a").run()
    reference = [r for r in read_metrics(tmp_path / "a" / "run") if r["step"] > 0]

    part = write_recipe(tmp_path / "b")
    Trainer(load_train_recipe(part, ["train.steps=2"]), recipe_root=tmp_path / "b").run()  # interrupted
    Trainer(load_train_recipe(part), resume=True, recipe_root=tmp_path / "b").run()
    resumed = [r for r in read_metrics(tmp_path / "b" / "run") if r["step"] > 0]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("reward/mean", "loss/total", "kl/ref", "grad_norm/total", "length/mean"):
        assert resumed[2][key] == pytest.approx(reference[2][key], rel=1e-5, abs=1e-7), key


def test_cli_train_and_bad_recipes(tmp_path, capsys):
    path = write_recipe(tmp_path, **{"train.steps": 1})
    assert main(["train", str(path), "train.eval_every=0"]) == 0
    assert main(["train", str(path), "train.eval_every=0"]) == 2  # the run dir holds a run: not overwritten
    assert "--resume" in capsys.readouterr().err
    assert main(["train", str(path), "rollout.gruop_size=4"]) == 2
    assert "gruop_size" in capsys.readouterr().err
    assert main(["train", str(path), "learner.lr=fast"]) == 2
    assert "learner.lr" in capsys.readouterr().err
    assert main(["train", str(path), "data.source=/no/such/file.jsonl"]) == 2
    assert "/no/such/file.jsonl" in capsys.readouterr().err
    assert main(["train", str(path), "rewards=[{fn: 'rewards/gsm8k.py:nope'}]"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("overrides", [
    ["algorithm.kl_in=reward", "algorithm.kl_coef=0.1"],
    ["algorithm.dynamic_sampling=true", "algorithm.max_refills=1"],
    ["algorithm.policy_logprob=rltt", "algorithm.omega=progressive", "rollout.schedule=dense",
     "rollout.exit_policy=sample"],
])
def test_algorithm_variants_run(tmp_path, overrides):
    path = write_recipe(tmp_path)
    trainer = Trainer(load_train_recipe(path, ["train.steps=2", "train.eval_every=0", *overrides]),
                           recipe_root=tmp_path)
    assert trainer.run().steps == 2
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert all("loss/total" in r and "kl/ref" in r for r in records)


def test_sharded_evaluation_merges_to_the_unsharded_result(tmp_path):
    """Data-parallel ranks evaluate disjoint task chunks; the merged sums are one process's."""
    from rltt.runtime.distributed import combine
    from rltt.orchestration.evaluator import EvalResult, evaluate
    from rltt.rollout import SamplingParams

    trainer = Trainer(load_train_recipe(write_recipe(tmp_path), ["data.eval_size=10"]), recipe_root=tmp_path)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=3)
    args = (trainer.engine, trainer.eval_tasks, trainer.tokenizer.decode, trainer.runner, params)
    whole = evaluate(*args, chunk=3)
    parts = [evaluate(*args, chunk=3, shard=(i, 3)) for i in range(3)]
    assert [len(p.per_task) for p in parts] == [4, 3, 3]  # chunks 0 and 3 (a single task), 1, 2
    merged = EvalResult(**combine([vars(p) for p in parts], EvalResult.OPS))
    assert (merged.solved, merged.samples, merged.tokens, merged.per_task) == \
        (whole.solved, whole.samples, whole.tokens, whole.per_task)
    assert merged.reward_sum == pytest.approx(whole.reward_sum) and merged.exit_step_sum == pytest.approx(whole.exit_step_sum)
    assert merged.solve_rate == whole.solve_rate and whole.samples == 20
