"""Every recipe family (train, curate, pretrain, convert) checks its keys the same way, at load:
an unknown key, a wrong type, an out-of-range value or a renamed key is a one-line error that
names the dotted key, before any model loads or file is written."""

from pathlib import Path

import pytest

from rltt.cli.main import main
from rltt.errors import ConfigError, RlttError
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.lm_training.stage_recipe import load_stage_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def load_train(overrides):
    return load_train_recipe(RECIPES / "quickstart.yaml", overrides)


def load_pretrain(overrides):
    return load_stage_recipe("pretrain", RECIPES / "pretrain-tiny.yaml", overrides)


def load_convert(overrides):
    return load_stage_recipe("convert", RECIPES / "convert-tiny.yaml", overrides)


FAMILIES = {"train": load_train, "pretrain": load_pretrain, "convert": load_convert}

BAD = {  # family -> [(override, key the error must name)]
    "train": [("rollout.temprature=1", "rollout.temprature"), ("bogus=1", "bogus"),
              ("train.steps=ten", "train.steps"), ("learner.pack_sequences=maybe", "learner.pack_sequences"),
              ("algorithm.loss=dpo", "algorithm.loss"), ("learner.zero_stage=4", "learner.zero_stage"),
              ("rollout.top_p=1.5", "rollout.top_p"), ("train.eval_every=-1", "train.eval_every"),
              ("algorithm.kl_coef=-0.1", "algorithm.kl_coef"), ("checkpoint.every=-1", "checkpoint.every"),
              ("data.limit=0", "data.limit"), ("logging.review_every=-2", "logging.review_every")],
    "pretrain": [("optim.lrr=1", "optim.lrr"), ("logging.everyy=1", "logging.everyy"),
                 ("train.steps=ten", "train.steps"), ("model.dtype=fp8", "model.dtype"),
                 ("optim.min_lr_ratio=2", "optim.min_lr_ratio"), ("logging.every=0", "logging.every"),
                 ("checkpoint.every=-1", "checkpoint.every"), ("objective.eps=1.5", "objective.eps"),
                 ("eval.temperature=-1", "eval.temperature"), ("alarm.p1_threshold=nan", "alarm.p1_threshold"),
                 ("data.block_size=1", "data.block_size"), ("seed=x", "seed")],
    "convert": [("model.num_loop=3", "model.num_loop"), ("model.num_loops=three", "model.num_loops"),
                ("model.num_loops=0", "model.num_loops"), ("model.injection=vector", "model.injection"),
                ("model.lora_rank=-1", "model.lora_rank"), ("train.grad_accum=0", "train.grad_accum"),
                ("optim.betas=[0.9, 1.5]", "optim.betas[1]")],
}


@pytest.mark.parametrize("family, override, key", [(f, o, k) for f, cases in BAD.items() for o, k in cases])
def test_bad_value_is_one_line_naming_the_key(family, override, key):
    with pytest.raises(ConfigError) as info:
        FAMILIES[family]([override])
    msg = str(info.value)
    assert f"'{key}'" in msg and "\n" not in msg, msg


def test_shipped_recipes_load_with_the_shared_names():
    train, pre, conv = load_train([]), load_pretrain([]), load_convert([])
    for recipe in (train, pre, conv):
        assert recipe.logging.run_dir and isinstance(recipe.seed, int) and recipe.checkpoint.every > 0
        assert recipe.model.dtype in ("fp32", "bf16") and recipe.model.device == "auto"
        assert "{question}" in recipe.data.prompt_template and recipe.train.steps >= 1
    assert pre.logging.run_dir == "runs/pretrain-tiny" and pre.checkpoint.every == 175 and pre.logging.every == 5
    assert conv.logging.run_dir == "runs/convert-tiny" and conv.checkpoint.every == 30
    assert train.logging.run_dir == "runs/quickstart" and train.checkpoint.every == 50


@pytest.mark.parametrize("family, old, new", [
    ("pretrain", "output_dir=/tmp/x", "logging.run_dir"),
    ("pretrain", "train.seed=1", "seed"),
    ("pretrain", "train.save_every=5", "checkpoint.every"),
    ("pretrain", "train.log_every=5", "logging.every"),
    ("pretrain", "train.progress=false", "logging.progress"),
    ("pretrain", "train.dtype=bf16", "model.dtype"),
    ("convert", "train.device=cpu", "model.device"),
    ("convert", "data.template=Q: {question}", "data.prompt_template"),
    ("convert", "data.hf_split=test", "data.split"),
    ("train", "learner.seed=3", "seed"),
    ("train", "output_dir=/tmp/x", "logging.run_dir"),
    ("train", "train.save_every=5", "checkpoint.every"),
])
def test_renamed_key_says_so(family, old, new):
    with pytest.raises(ConfigError) as info:
        FAMILIES[family]([old])
    key = old.partition("=")[0]
    assert f"recipe key '{key}' was renamed to '{new}'" in str(info.value) and "\n" not in str(info.value)


def test_renamed_key_in_a_yaml_file(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("output_dir: runs/x\ntrain:\n  steps: 3\n  save_every: 2\n")
    with pytest.raises(ConfigError, match=r"old\.yaml: recipe key '(output_dir|train\.save_every)' was renamed"):
        load_stage_recipe("pretrain", path)


def test_curate_family_fails_in_one_line_before_any_work(tmp_path, capsys):
    out = tmp_path / "curated.jsonl"
    for override, key in [("rollout.bogus=1", "rollout.bogus"), ("rollout.group_size=x", "rollout.group_size"),
                          ("rollout.top_k=-1", "rollout.top_k"), ("learner.seed=1", "learner.seed")]:
        code = main(["curate", str(RECIPES / "quickstart.yaml"), override, "--out", str(out), "--limit", "2",
                     "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.count("\n") == 0 and f"'{key}'" in err, err
    assert not out.exists()


@pytest.mark.parametrize("command", ["train", "pretrain", "convert", "eval"])
def test_cli_of_every_family_prints_the_key(command, tmp_path, capsys):
    recipe = {"train": "quickstart.yaml", "eval": "quickstart.yaml", "pretrain": "pretrain-tiny.yaml",
              "convert": "convert-tiny.yaml"}[command]
    run_dir = tmp_path / "run"
    code = main([command, str(RECIPES / recipe), f"logging.run_dir={run_dir}", "train.steps=-3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "'train.steps'" in err, err
    assert not run_dir.exists()


def test_directly_built_sections_obey_the_same_constraints():
    from rltt.learner.settings import AlgorithmConfig, LearnerConfig

    with pytest.raises(ConfigError, match=r"'algorithm\.omega'"):
        AlgorithmConfig(omega="bogus")
    with pytest.raises(ConfigError, match=r"'learner\.lr'"):
        LearnerConfig(lr=float("nan"))
    assert LearnerConfig(lr=1).lr == 1.0 and isinstance(LearnerConfig(lr=1).lr, float)


def test_errors_are_rltt_errors():
    assert issubclass(ConfigError, RlttError)
