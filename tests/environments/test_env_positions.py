"""An episode's last turn runs on the prompt and the whole history: a recipe whose prompt budget plus
``env.max_tokens`` can exceed the model's positions is refused when it loads (one line naming
``env.max_tokens``), and the trainer checks each prompt against ``env.max_tokens`` as it checks a
single-turn prompt against ``rollout.max_new_tokens``."""

import json
from types import SimpleNamespace

import pytest

from rltt.config import ConfigError
from rltt.errors import RlttError
from rltt.orchestration.prompt_stream import Task
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.orchestration.trainer import Trainer

from .test_environments import RECIPES

POSITIONS = 600


@pytest.fixture
def checkpoint(tmp_path):
    """A local checkpoint folder whose config.json says its positions (all a recipe reads when it loads)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "rltt", "num_loops": 4,
                                                      "max_position_embeddings": POSITIONS}))
    return tmp_path


def _load(checkpoint, *overrides):
    return load_train_recipe(RECIPES / "quickstart-tools.yaml", [f"model.path={checkpoint}", *overrides])


def test_a_prompt_budget_and_episode_past_the_positions_is_refused_naming_the_key(checkpoint):
    with pytest.raises(ConfigError) as info:  # data.max_prompt_tokens 512 (default) + env.max_tokens 96 > 600
        _load(checkpoint)
    message = str(info.value)
    assert "'env.max_tokens'" in message and "max_position_embeddings=600" in message and "\n" not in message
    assert _load(checkpoint, "data.max_prompt_tokens=504").env.max_tokens == 96  # 504 + 96 = 600 fits
    with pytest.raises(ConfigError, match="'env.max_tokens'"):
        _load(checkpoint, "data.max_prompt_tokens=504", "env.max_tokens=97")
    assert _load(checkpoint, "env.name=none").rollout.max_new_tokens == 48  # single-turn: not an episode


def test_the_trainer_checks_each_prompt_against_the_episode_budget(checkpoint):
    recipe = _load(checkpoint, "data.max_prompt_tokens=504")
    long = Task("held-7", "q", list(range(POSITIONS - 96 + 1)), "1")  # fits a 48-token turn, not the episode
    trainer = SimpleNamespace(model_path=checkpoint, recipe=recipe, eval_tasks=[long],
                              prompts=SimpleNamespace(check_lengths=lambda limit, key, what: None))
    with pytest.raises(RlttError) as info:
        Trainer._check_prompt_lengths(trainer)
    assert "env.max_tokens=96" in str(info.value) and "'held-7'" in str(info.value)
    trainer.eval_tasks = [Task("held-8", "q", list(range(POSITIONS - 96)), "1")]
    Trainer._check_prompt_lengths(trainer)
