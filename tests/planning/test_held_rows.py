"""The plan's host-memory line for the rows an asynchronous run holds ahead
(``orchestration.max_staleness`` K ≥ 1): one held step counted by `HeldRows` equals the bytes of a
real step's rows as the driver holds them (`OverlappedStep.ahead`: a `Sampled` of `ScoredGroups`),
at their padded width; the plan's line is K such steps at the plan's sequence width, which bounds that
width. (tests/orchestration/ray/test_async_faults.py checks the same count against the rows in a
K = 2 run's checkpoint.)"""

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import yaml

from rltt.orchestration.train_recipe import load_train_recipe
from rltt.orchestration.trainer import Trainer
from rltt.planning import plan_run
from rltt.planning.held_rows import HeldRows
from rltt.planning.plan_table import format_plan

from ..orchestration.test_local import write_recipe
from .helpers import TINY_LOOPED

LOCAL = ["train.eval_every=0", "checkpoint.every=0"]


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("held")
    return root, write_recipe(root)


def held_step(root, path, overrides):
    """One step's rows as `OverlappedStep` holds them (every field of its `ScoredGroups` and their
    `LearnerBatch`), and the resolved recipe."""
    trainer = Trainer(load_train_recipe(path, [*LOCAL, *overrides]), recipe_root=root)
    try:
        groups, metrics = trainer.training.rollout(1)
    finally:
        trainer.close()
    held = {f.name: getattr(groups, f.name) for f in fields(groups)}
    held["batch"] = {f.name: getattr(groups.batch, f.name) for f in fields(groups.batch)}
    return held, trainer.recipe


@pytest.mark.parametrize("overrides, flags", [
    ([], {"truncates": False, "compute": False}),
    (["rollout.top_p=0.8"], {"truncates": True, "compute": False}),
    (["rollout.exit_policy=sample", "algorithm.compute_cost=0.01"], {"truncates": False, "compute": True}),
], ids=["plain", "top_p", "compute_cost"])
def test_a_held_step_is_the_count_at_its_padded_width(tiny, overrides, flags, tmp_path):
    root, path = tiny
    plain, recipe = held_step(root, path, [*overrides, f"logging.run_dir={tmp_path / 'run'}"])
    batch = plain["batch"]
    rows, width = batch["input_ids"].shape
    held = HeldRows.from_recipe(recipe, positions=recipe.data.max_prompt_tokens + recipe.rollout.max_new_tokens)
    assert {k: getattr(held, k) for k in flags} == flags
    assert (batch["kept_floor"] is not None) == flags["truncates"]  # the term counts a tensor that is there
    assert rows == held.rows == recipe.rollout.prompts_per_step * recipe.rollout.group_size
    assert held.step_bytes(width) == tensor_bytes(plain)


def test_the_plan_counts_k_steps_at_its_sequence_width_for_a_ray_run_only(tiny, tmp_path):
    root, path = tiny
    plain, local = held_step(root, path, [f"logging.run_dir={tmp_path / 'run'}"])
    config = json.loads((root / "policy" / "config.json").read_text())
    ray = load_train_recipe(path, ["orchestration.backend=ray", "orchestration.max_staleness=2"])
    plan = plan_run(ray, config, 16 * 2**30, device="cpu")
    one = HeldRows.from_recipe(ray, plan.sequence_tokens)
    assert plan.host == {"held_ahead": 2 * one.step_bytes()} and one.steps == 2
    assert plain["batch"]["input_ids"].shape[1] <= plan.sequence_tokens  # the plan's width bounds a step's
    assert one.step_bytes() >= tensor_bytes(plain)
    assert "rows held ahead (K steps)" in format_plan(plan) and plan.to_json()["host"] == plan.host
    assert plan_run(local, config, 16 * 2**30, device="cpu").host == {}  # K = 0: nothing held
    k0 = load_train_recipe(path, ["orchestration.backend=ray"])
    assert plan_run(k0, config, 16 * 2**30, device="cpu").host == {}


RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_the_longtail_recipe_is_the_quickstart_with_longer_completions_on_ray_and_plans_its_held_rows():
    quick = yaml.safe_load((RECIPES / "quickstart.yaml").read_text())
    tail = yaml.safe_load((RECIPES / "quickstart-longtail.yaml").read_text())
    assert tail.pop("orchestration") == {"backend": "ray", "max_staleness": 2,
                                         "ray": {"rollout_workers": 1, "learners": 1, "num_cpus": 1}}
    assert (tail["rollout"].pop("max_new_tokens"), quick["rollout"].pop("max_new_tokens")) == (80, 48)
    assert (tail["logging"].pop("run_dir"), quick["logging"].pop("run_dir")) == ("runs/quickstart-longtail",
                                                                                 "runs/quickstart")
    assert tail == quick
    recipe = load_train_recipe(RECIPES / "quickstart-longtail.yaml")
    plan = plan_run(recipe, TINY_LOOPED, 16 * 2**30, device="cpu")
    assert plan.host == {"held_ahead": 2 * HeldRows.from_recipe(recipe, plan.sequence_tokens).step_bytes()}
