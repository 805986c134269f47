"""`ModelSource`: what a model folder says before any weights load (T, positions), read once."""

import json

import pytest

from rltt.errors import RlttError
from rltt.model.model_source import ModelSource
from rltt.orchestration.train_recipe import load_train_recipe

from tests.test_recipe_values import QUICKSTART, train_error


def folder(tmp_path, config, name="m"):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("config, loops", [
    ({"model_type": "rltt_looped", "num_loops": 3}, 3),
    ({"model_type": "ouro", "total_ut_steps": 2}, 2),
    ({"model_type": "ouro"}, 4),  # Ouro's default, as its loader maps it
    ({"model_type": "qwen2"}, None),  # dense: the conversion sets T
    ({"model_type": "rltt_looped", "num_loops": True}, None),
])
def test_loops_and_positions_by_model_type(tmp_path, config, loops):
    source = ModelSource.read(folder(tmp_path, {**config, "max_position_embeddings": 64}))
    assert source.num_loops == loops and source.max_positions == 64


def test_what_is_not_a_local_source(tmp_path):
    assert ModelSource.local("quickstart") is None and ModelSource.local("org/model") is None
    assert ModelSource.local(tmp_path) is None  # no config.json
    (tmp_path / "config.json").write_text("[1]")
    assert ModelSource.local(tmp_path) is None
    with pytest.raises(RlttError, match=r"^model.path: .*config.json does not hold a JSON object$"):
        ModelSource.read(tmp_path)


def test_a_recipe_checks_fixed_k_against_an_ouro_checkpoint(tmp_path):
    ouro = folder(tmp_path, {"model_type": "ouro", "total_ut_steps": 4})
    assert "1..4" in train_error(f"model.path={ouro}", "rollout.exit_policy=fixed:5")
    assert load_train_recipe(QUICKSTART, [f"model.path={ouro}", "rollout.exit_policy=fixed:4"]).rollout.exit_policy
