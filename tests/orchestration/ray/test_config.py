"""The orchestration recipe section: bad values are one-line errors naming the key."""

import pytest

from rltt.errors import ConfigError
from rltt.orchestration.orchestration_section import check_recipe
from rltt.orchestration.train_recipe import load_train_recipe

from ..test_local import write_recipe


@pytest.mark.parametrize("overrides, key", [
    (["orchestration.backend=spark"], "orchestration.backend"),
    (["orchestration.overlap=1"], "orchestration.overlap"),  # needs backend=ray
    (["orchestration.max_staleness=2"], "orchestration.max_staleness"),  # needs backend=ray
    (["orchestration.max_staleness=-1"], "orchestration.max_staleness"),
    (["orchestration.backend=ray", "orchestration.overlap=1", "orchestration.max_staleness=2"],
     "orchestration.overlap"),  # the alias contradicts the key
    (["orchestration.backend=ray", "orchestration.overlap=0", "orchestration.max_staleness=1"],
     "orchestration.overlap"),
    (["orchestration.backend=ray", "orchestration.ray.rollout_workers=0"], "orchestration.ray.rollout_workers"),
    (["orchestration.backend=ray", "orchestration.ray.timeout_s=0"], "orchestration.ray.timeout_s"),
    (["orchestration.backend=ray", "orchestration.ray.sync=nccl"], "orchestration.ray.sync"),
    (["orchestration.partial_rollouts=true"], "orchestration.partial_rollouts"),  # needs backend=ray
    (["orchestration.backend=ray", "orchestration.partial_rollouts=true"], "orchestration.partial_rollouts"),  # K=0
    (["orchestration.backend=ray", "orchestration.max_staleness=0", "orchestration.partial_rollouts=true"],
     "orchestration.partial_rollouts"),
    (["orchestration.backend=ray", "orchestration.max_staleness=1", "orchestration.partial_rollouts=true",
      "orchestration.partial_segment_tokens=0"], "orchestration.partial_segment_tokens"),
])
def test_bad_orchestration_values(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as err:
        load_train_recipe(write_recipe(tmp_path), overrides)
    assert key in str(err.value) and "\n" not in str(err.value)


PARTIAL = ["orchestration.max_staleness=2", "orchestration.partial_rollouts=true"]


@pytest.mark.parametrize("overrides, key", [
    (["orchestration.ray.learners=2"], "orchestration.ray.learners"),  # the torch backend is one process
    (["orchestration.ray.learners=4", "learner.backend=deepspeed"], "orchestration.ray.learners"),  # 2 prompts
    (["orchestration.overlap=1", "algorithm.hybrid_logprob=false"], "orchestration.overlap"),
    (["orchestration.max_staleness=2", "algorithm.hybrid_logprob=false"], "orchestration.max_staleness"),
    ([*PARTIAL, "algorithm.dynamic_sampling=true"], "orchestration.partial_rollouts"),
])
def test_cross_section_checks(tmp_path, overrides, key):
    recipe = load_train_recipe(write_recipe(tmp_path), ["orchestration.backend=ray", *overrides])
    with pytest.raises(ConfigError) as err:
        check_recipe(recipe)
    assert key in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, K", [
    ([], 0),
    (["orchestration.overlap=1"], 1),  # the alias
    (["orchestration.overlap=1", "orchestration.max_staleness=1"], 1),
    (["orchestration.max_staleness=2"], 2),
    (["orchestration.max_staleness=4", "algorithm.hybrid_logprob=false", "algorithm.correction=decoupled",
      "algorithm.decoupled_cap=3"], 4),
])
def test_max_staleness_and_its_alias(tmp_path, overrides, K):
    recipe = load_train_recipe(write_recipe(tmp_path), ["orchestration.backend=ray", *overrides])
    check_recipe(recipe)
    assert recipe.orchestration.staleness == recipe.orchestration.max_staleness == K
    assert recipe.algorithm.decoupled_cap == (3.0 if "algorithm.decoupled_cap=3" in overrides else 5.0)


def test_partial_rollouts_settings(tmp_path):
    recipe = load_train_recipe(write_recipe(tmp_path), ["orchestration.backend=ray", *PARTIAL,
                                                        "orchestration.partial_segment_tokens=8",
                                                        "rollout.thinking.budget=4", "algorithm.kl_in=reward"])
    check_recipe(recipe)  # a thinking budget is counted across a row's segments, the reward's KL between updates
    assert recipe.algorithm.kl_coef > 0
    o = recipe.orchestration
    assert o.partial_rollouts and o.partial_segment_tokens == 8 and o.staleness == 2
