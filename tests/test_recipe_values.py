"""Every recipe value is checked when the recipe loads — before any model loads and before
anything is written — and the one-line error names the dotted recipe key (never an internal
``SamplingParams.*`` field)."""

from pathlib import Path

import pytest

from rltt.cli.main import main
from rltt.errors import ConfigError, RlttError
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.lm_training.stage_recipe import load_stage_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
QUICKSTART = RECIPES / "quickstart.yaml"


def train_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_train_recipe(QUICKSTART, list(overrides))
    msg = str(info.value)
    assert "\n" not in msg and "SamplingParams" not in msg, msg
    return msg


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
def test_rollout_temperature_must_be_finite_and_positive(value):
    assert "'rollout.temperature'" in train_error(f"rollout.temperature={value}")


@pytest.mark.parametrize("value", ["2", "0", "-0.5", "nan"])
def test_rollout_top_p_in_zero_one(value):
    assert "'rollout.top_p'" in train_error(f"rollout.top_p={value}")


def test_rollout_top_k_non_negative():
    assert "'rollout.top_k'" in train_error("rollout.top_k=-1")


@pytest.mark.parametrize("value", ["bogus", "fixed:0", "fixed:x", "threshold:1.5", "threshold:nan", "final:2"])
def test_rollout_exit_policy_parsed_naming_the_key(value):
    msg = train_error(f"rollout.exit_policy={value}")
    assert "'rollout.exit_policy'" in msg


def test_rollout_exit_policy_fixed_k_checked_against_a_known_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"num_loops": 4}')
    assert "1..4" in train_error(f"model.path={ckpt}", "rollout.exit_policy=fixed:5")
    assert load_train_recipe(QUICKSTART, [f"model.path={ckpt}", "rollout.exit_policy=fixed:4"]).rollout.exit_policy


def test_good_exit_policies_load():
    for spec in ("final", "fixed:2", "threshold:0.5", "sample"):
        assert load_train_recipe(QUICKSTART, [f"rollout.exit_policy={spec}"]).rollout.exit_policy == spec


def test_eval_exit_policy_of_the_lm_stages_knows_num_loops():
    with pytest.raises(ConfigError, match=r"'eval\.exit_policy'.*1\.\.4"):  # pretrain-tiny has T = 4
        load_stage_recipe("pretrain", RECIPES / "pretrain-tiny.yaml", ["eval.exit_policy=fixed:5"])
    with pytest.raises(ConfigError, match=r"'eval\.exit_policy'.*1\.\.3"):
        load_stage_recipe("convert", RECIPES / "convert-tiny.yaml", ["eval.exit_policy=fixed:4"])


def test_eval_samples_at_least_one():
    assert "'train.eval_samples'" in train_error("train.eval_samples=0")


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_eval_temperature_finite_non_negative(value):
    assert "'train.eval_temperature'" in train_error(f"train.eval_temperature={value}")


def test_eval_temperature_zero_is_greedy_and_allowed():
    assert load_train_recipe(QUICKSTART, ["train.eval_temperature=0"]).train.eval_temperature == 0.0


def test_group_size_one_can_never_learn():
    msg = train_error("rollout.group_size=1")
    assert "'rollout.group_size'" in msg and "never learn" in msg and "uniform" in msg


@pytest.mark.parametrize("override, key", [("checkpoint.every=-1", "checkpoint.every"),
                                           ("train.eval_every=-3", "train.eval_every"),
                                           ("logging.review_every=-1", "logging.review_every")])
def test_negative_intervals_rejected(override, key):
    assert f"'{key}'" in train_error(override)


def test_zero_intervals_mean_off():
    r = load_train_recipe(QUICKSTART, ["checkpoint.every=0", "train.eval_every=0"])
    assert r.checkpoint.every == 0 and r.train.eval_every == 0


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1e-5"])
def test_learner_lr_finite_positive(value):
    assert "'learner.lr'" in train_error(f"learner.lr={value}")


def test_learner_lr_nan_in_the_yaml_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(QUICKSTART.read_text().replace("lr: 1.0e-4", "lr: .nan"))
    with pytest.raises(ConfigError, match=r"r\.yaml: recipe key 'learner\.lr': must be a finite number"):
        load_train_recipe(path)


def test_non_utf8_recipe_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model:\n  path: caf\xe9\n".encode("latin-1"))
    for load in (load_train_recipe, lambda p: load_stage_recipe("pretrain", p)):
        with pytest.raises(RlttError) as info:
            load(path)
        msg = str(info.value)
        assert "latin1.yaml" in msg and "UTF-8" in msg and "\n" not in msg


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_empty_recipe_is_one_line(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    for load in (load_train_recipe, lambda p: load_stage_recipe("convert", p)):
        with pytest.raises(RlttError) as info:
            load(path)
        assert "empty.yaml" in str(info.value) and "empty" in str(info.value).split(":", 1)[1]


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device_without_gpu_names_model_device(monkeypatch, tmp_path, capsys, device):
    """A CUDA recipe loads anywhere (`rltt plan` plans it on a laptop); the commands that run it stop
    in one line naming the key before they write anything (tests/cli/test_cuda_unusable.py: why)."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_train_recipe(QUICKSTART, [f"model.device={device}"]).model.device == device
    for kind, recipe in (("train", "quickstart.yaml"), ("pretrain", "pretrain-tiny.yaml"),
                         ("convert", "convert-tiny.yaml")):
        if kind != "train":
            load_stage_recipe(kind, RECIPES / recipe, [f"model.device={device}"])
        run_dir = tmp_path / kind
        assert main([kind, str(RECIPES / recipe), f"model.device={device}", f"logging.run_dir={run_dir}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "'model.device'" in err and "built without CUDA" in err, err
        assert not run_dir.exists()


def test_device_name_is_checked():
    assert "'model.device'" in train_error("model.device=tpu")


def test_bad_value_fails_before_anything_is_written(tmp_path, capsys):
    run_dir = tmp_path / "run"
    for override in ("rollout.temperature=nan", "rollout.top_p=2", "rollout.exit_policy=bogus",
                     "train.eval_samples=0", "train.eval_temperature=-1", "rollout.group_size=1", "learner.lr=inf"):
        code = main(["train", str(QUICKSTART), f"logging.run_dir={run_dir}", override])
        err = capsys.readouterr().err.strip()
        key = override.partition("=")[0]
        assert code == 2 and err.count("\n") == 0 and f"'{key}'" in err, err
        assert not run_dir.exists()
