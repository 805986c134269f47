"""The environment table, the ``env:`` recipe section (one-line errors naming the key), the
``tools`` and ``annotations`` environments on the real tool layer, and the plan's sequence length."""

from pathlib import Path

import pytest

from rltt.config import ConfigError
from rltt.environments import ENVIRONMENTS, EnvReply, make_environment
from rltt.environments.annotation_env import AnnotationEnvironment
from rltt.environments.tool_env import ToolEnvironment
from rltt.orchestration.components import completion_budget
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.planning.run_settings import RunSettings

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _load(name="quickstart-tools.yaml", *overrides):
    return load_train_recipe(RECIPES / name, list(overrides))


def test_the_tool_recipes_load_with_their_environments():
    quick = _load()
    assert quick.env.name == "annotations" and quick.env.max_turns == 8 and quick.env.max_tokens == 96
    assert isinstance(make_environment(quick.env), AnnotationEnvironment)
    gsm = _load("gsm8k-tools.yaml", "model.path=quickstart")
    assert gsm.env.name == "tools" and gsm.env.tools == ["python"] and gsm.data.prompt_format == "chat"
    env = make_environment(gsm.env)
    assert isinstance(env, ToolEnvironment) and env.stop_strings == ("</tool>",)
    assert env.limits.timeout_s == 5.0 and env.limits.memory_mb == 512 and env.limits.output_chars == 1024
    assert make_environment(_load("quickstart.yaml").env) is None  # no env section: single-turn
    assert set(ENVIRONMENTS) == {"tools", "annotations"}


@pytest.mark.parametrize("override, key", [
    ("env.name=chess", "env.name"),
    ("env.max_turns=0", "env.max_turns"),
    ("env.max_tokens=0", "env.max_tokens"),
    ("env.max_tokens=16", "rollout.max_new_tokens"),
    ("env.limits.memory_mb=8", "env.limits.memory_mb"),
    ("env.limits.output_chars=10", "env.limits.output_chars"),
    ("env.limits.timeout_s=0", "env.limits.timeout_s"),
    ("env.stop_strings=[x]", "env.stop_strings"),
    ("rollout.thinking.budget=8", "rollout.thinking.budget"),
    ("orchestration.backend=ray", "orchestration.backend"),
])
def test_bad_env_values_fail_in_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        _load("quickstart-tools.yaml", override)
    message = str(info.value)
    assert f"'{key}'" in message and "\n" not in message, message


@pytest.mark.parametrize("override", ["env.tools=[]", "env.tools=[shell]", "env.stop_strings=['']"])
def test_bad_tools_fail_naming_the_key(override):
    with pytest.raises(ConfigError) as info:
        _load("gsm8k-tools.yaml", "model.path=quickstart", override)
    assert "env." in str(info.value) and "\n" not in str(info.value)


def test_the_plan_counts_the_longest_episode():
    recipe = _load("gsm8k-tools.yaml", "model.path=quickstart")
    settings = RunSettings.from_recipe(recipe, "cuda")
    assert settings.completion_tokens == recipe.env.max_tokens == 1024 and recipe.rollout.max_new_tokens == 512
    single = _load("gsm8k-tools.yaml", "model.path=quickstart", "env.name=none")
    assert RunSettings.from_recipe(single, "cuda").completion_tokens == 512
    assert completion_budget(recipe) == 1024 and completion_budget(single) == 512


def test_the_tools_environment_runs_the_call_and_answers_with_its_result():
    env = ToolEnvironment(["calculator"])
    reply = env.step(None, 'Let me compute. <tool name="calculator">123456789 * 987654321</tool>')
    assert reply == EnvReply("\n<tool_result>\n121932631112635269\n</tool_result>\n", tool_call=True)
    assert env.step(None, "The answer is #### 7") == EnvReply(None)  # no call: the episode ends
    unknown = env.step(None, '<tool name="python">print(1)</tool>')  # not one of env.tools
    assert unknown.tool_call and unknown.tool_error and "unknown tool 'python'" in unknown.text
    failed = env.step(None, '<tool name="calculator">1/0</tool>')
    assert failed.tool_error and 'error="math"' in failed.text


def test_the_python_tool_runs_sandboxed():
    env = ToolEnvironment(["python"])
    reply = env.step(None, 'Compute it: <tool name="python">print(2**100)</tool>')
    assert reply.tool_call and not reply.tool_error and "1267650600228229401496703205376" in reply.text


def test_the_annotations_environment_answers_open_annotations_only():
    env = AnnotationEnvironment()
    assert env.step(None, " Ann has 61961+25337 =") == EnvReply("")  # "=" outside an annotation: go on
    assert env.step(None, " <<61961+25337=") == EnvReply("87298>>", tool_call=True)
    assert env.step(None, " <<12*(3+4)=") == EnvReply("84>>", tool_call=True)
    assert env.step(None, " <<7/0=") == EnvReply("?>>", tool_call=True, tool_error=True)
    assert env.step(None, " <<1+1=2>>2 apples =") == EnvReply("")  # the annotation is closed
    assert env.step(None, " 87298 apples.\n#### 87298") == EnvReply(None)  # the last turn
