"""Fuzz of recipe overrides and YAML values for the train and pretrain families: whatever the
key, type or value (nan, inf, negative, huge, strings, lists, mappings), a recipe either loads
or fails with a one-line `RlttError` naming a recipe key — never another exception."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rltt.errors import RlttError
from rltt.orchestration.train_recipe import TrainRecipe, load_train_recipe
from rltt.lm_training.stage_recipe import PretrainRecipe, load_stage_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def schema_keys(cls, prefix="") -> list[str]:
    """Every dotted key of schema ``cls`` (sections and leaves), plus the renamed ones."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        keys.append(dotted)
        tp = hints[f.name]
        inner = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp):
            inner = [tp]
        for sub in inner:
            keys += schema_keys(sub, dotted + ".")
    return keys + list(getattr(cls, "RENAMED", {}))


FAMILIES = {
    "train": (TrainRecipe, lambda ov: load_train_recipe(RECIPES / "quickstart.yaml", ov)),
    "pretrain": (PretrainRecipe, lambda ov: load_stage_recipe("pretrain", RECIPES / "pretrain-tiny.yaml", ov)),
}
KEYS = {name: schema_keys(cls) for name, (cls, _) in FAMILIES.items()}
BOGUS = ["bogus", "train.bogus", "model.config.hidden_sise", "rollout.temperature.x", "learner.lr.y",
         "model.config.num_loops", "model.config.hidden_size", "data.difficulty.digits", "rewards.0"]

SCALARS = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "-1", "0", "1", "2", "-0.5", "1e400", "1e30", "1e-30", "true", "null",
                     "[]", "[1, 2]", "{a: 1}", "[0.9, nan]", "fixed:3", "final", "cuda", "cpu", "bf16", "x:y",
                     "synthetic", "synthetic:bogus", "'quoted'", "~", "{", "]", ": :", "\\n", "hf:"]),
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False).map(repr),
    st.text(max_size=30),
)


def key_named(message: str) -> bool:
    return bool(re.search(r"recipe key '[^']+'", message)) or message.startswith("override ")


def check(load, overrides):
    try:
        load(overrides)
    except RlttError as exc:
        msg = str(exc)
        assert "\n" not in msg, msg
        assert key_named(msg), msg


@pytest.mark.parametrize("family", list(FAMILIES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_overrides_load_or_fail_in_one_line_naming_a_key(family, data):
    keys = st.sampled_from(KEYS[family] + BOGUS)
    pairs = data.draw(st.lists(st.tuples(keys, SCALARS), min_size=1, max_size=3))
    check(FAMILIES[family][1], [f"{key}={value}" for key, value in pairs])


VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**40), max_value=10**40),
              st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6,
)


def set_path(data: dict, key: str, value) -> dict:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value
    return data


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_yaml_values_load_or_fail_in_one_line_naming_a_key(data):
    family = data.draw(st.sampled_from(["train", "pretrain"]))
    cls, _ = FAMILIES[family]
    base: dict = {}
    for key, value in data.draw(st.lists(st.tuples(st.sampled_from(KEYS[family] + BOGUS), VALUES),
                                         min_size=1, max_size=3)):
        set_path(base, key, value)
    if family == "train":
        from rltt.config import load_recipe

        load = lambda ov: load_recipe(cls, None, ov, data=base)  # noqa: E731
    else:
        load = lambda ov: load_stage_recipe("pretrain", None, ov, data=base)  # noqa: E731
    check(load, [])
