"""An exit policy's text is parsed once, where it enters rltt (a recipe, a flag, `SamplingParams`,
a model's config per value): the engines never parse it per call."""

import pickle
from pathlib import Path

import pytest

from rltt.config import to_dict
from rltt.errors import RlttError
from rltt.model.exits import ExitPolicy
from rltt.orchestration.policy import sampling_params
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.rollout import NativeEngine, SamplingParams
from rltt.vllm import row_exits
from rltt.vllm.vllm_engine import VllmEngine

from .helpers import prompts, tiny_model

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """Every `ExitPolicy.parse` call from here on (its spec), the parse itself unchanged."""
    calls: list[str] = []
    parse = ExitPolicy.parse.__func__

    def counted(cls, spec, *args, **kw):
        calls.append(spec)
        return parse(cls, spec, *args, **kw)

    monkeypatch.setattr(ExitPolicy, "parse", classmethod(counted))
    return calls


def test_sampling_params_hold_the_parsed_policy_and_pickle():
    params = SamplingParams(exit_policy="threshold:0.5", seed=1)
    assert params.exit_policy == ExitPolicy("threshold", 0.5)
    back = pickle.loads(pickle.dumps(params))  # params travel to Ray workers
    assert back == params and isinstance(back.exit_policy, ExitPolicy)
    one = SamplingParams(exit_policy="threshold:1").exit_policy  # shown (eval JSON, fingerprints) as written
    assert one == ExitPolicy("threshold", 1.0) and str(one) == "threshold:1" and str(ExitPolicy("fixed", 2)) == "fixed:2"
    late = SamplingParams()
    late.exit_policy = "fixed:2"  # text set after the params were built: parsed when validated
    assert late.validate(4).exit_policy == ExitPolicy("fixed", 2)
    with pytest.raises(RlttError, match=r"SamplingParams\.exit_policy.*1\.\.3"):
        SamplingParams(exit_policy="fixed:4").validate(3)  # k is checked against each model's T


@pytest.mark.parametrize("policy", ["fixed:2", "threshold:0.5", None])
def test_native_generate_parses_no_policy(parses, policy):
    engine = NativeEngine(tiny_model(num_loops=3, exit_policy="fixed:1"))
    params = SamplingParams(max_new_tokens=4, seed=0, exit_policy=policy)
    engine.generate(prompts([3, 2]), params)  # the model parses its config's policy once (None)
    parses.clear()
    batch = engine.generate(prompts([3, 2]), params)
    assert parses == []
    if policy != "threshold:0.5":
        assert (batch.exit_steps[batch.completion_mask] == (2 if policy else 1)).all()


def test_a_changed_model_config_policy_is_parsed_again(parses):
    engine = NativeEngine(tiny_model(num_loops=3, exit_policy="fixed:1"))
    params = SamplingParams(max_new_tokens=4, seed=0)
    engine.model.config.exit_policy = "fixed:3"
    parses.clear()  # the config validated its own policy when built
    batch = engine.generate(prompts([3]), params)
    assert (batch.exit_steps[batch.completion_mask] == 3).all()
    assert parses == ["fixed:3"]
    engine.generate(prompts([3]), params)
    assert parses == ["fixed:3"]


def test_vllm_engine_check_parses_no_policy(parses):
    engine = object.__new__(VllmEngine)  # check_params reads the config only: no vLLM started
    engine.config = tiny_model(num_loops=3, exit_policy="threshold:0.5").config
    row_exits.parse_policy.cache_clear()
    params = SamplingParams(temperature=0, max_new_tokens=4, exit_policy="fixed:2", schedule="dense")
    parses.clear()
    assert engine.check_params(params) == ExitPolicy("fixed", 2) and parses == []
    default = SamplingParams(temperature=0, max_new_tokens=4, schedule="dense")
    assert engine.check_params(default) == ExitPolicy("threshold", 0.5) and parses == ["threshold:0.5"]
    assert engine.check_params(default) == ExitPolicy("threshold", 0.5) and parses == ["threshold:0.5"]


def test_a_recipe_parses_its_policies_when_it_loads(parses):
    recipe = load_train_recipe(QUICKSTART, ["rollout.exit_policy=sample", "train.eval_exit_policy=threshold:0.9"])
    assert parses == ["sample", "threshold:0.9"]
    params = sampling_params(recipe.rollout, [0], None, n=2, seed=3)
    assert params.exit_policy == ExitPolicy("sample") and parses == ["sample", "threshold:0.9"]
    assert to_dict(recipe)["rollout"]["exit_policy"] == "sample"  # the saved recipe keeps its text
    recipe.rollout.exit_policy = "fixed:1"  # a changed value is parsed again
    assert sampling_params(recipe.rollout, [0], None).exit_policy == ExitPolicy("fixed", 1)
