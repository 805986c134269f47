"""rltt.config: typed recipes from YAML with dotted overrides and one-line errors."""

from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from rltt.config import apply_overrides, from_dict, load_recipe, recipe_error, to_dict
from rltt.errors import ConfigError, RlttError


@dataclass
class Inner:
    lr: float = 1e-3
    steps: int = 10
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    kind: Literal["bpe", "char"] = "bpe"

    def validate(self):
        if self.steps < 1:
            raise recipe_error("optim.steps", f"must be >= 1, got {self.steps}")


@dataclass
class Opt:
    path: str = "x"


@dataclass
class Recipe:
    name: str = "run"
    flag: bool = False
    seed: int | None = None
    optim: Inner = field(default_factory=Inner)
    extra: dict[str, Any] = field(default_factory=dict)
    maybe: Opt | None = None


def test_defaults_and_yaml(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: a\noptim:\n  lr: 2\n  kind: char\nextra:\n  hidden_size: 64\n")
    r = load_recipe(Recipe, path)
    assert r.name == "a" and r.optim.lr == 2.0 and isinstance(r.optim.lr, float)
    assert r.optim.kind == "char" and r.extra == {"hidden_size": 64} and r.optim.steps == 10


def test_overrides_are_typed(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("optim: {lr: 1}\n")
    r = load_recipe(Recipe, path, ["optim.steps=20", "optim.lr=3e-4", "flag=true", "seed=7", "name=123",
                                   "extra.a.b=5", "optim.betas=[0.8, 0.9]", "maybe.path=/p"])
    assert r.optim.steps == 20 and r.optim.lr == 3e-4 and r.flag is True and r.seed == 7
    assert r.name == "123"  # a str field keeps the text
    assert r.extra == {"a": {"b": 5}} and r.optim.betas == [0.8, 0.9] and r.maybe.path == "/p"
    assert load_recipe(Recipe, None, ["seed=null"]).seed is None


@pytest.mark.parametrize("override, key", [
    ("optim.stepz=3", "optim.stepz"),
    ("bogus=1", "bogus"),
    ("optim.steps=abc", "optim.steps"),
    ("flag=maybe", "flag"),
    ("optim.kind=word", "optim.kind"),
    ("name.x=1", "name"),
])
def test_bad_override_names_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_recipe(Recipe, None, [override])
    msg = str(info.value)
    assert key in msg and "\n" not in msg


@pytest.mark.parametrize("data, key", [
    ({"optim": {"lr": "fast"}}, "optim.lr"),
    ({"optim": {"steps": 1.5}}, "optim.steps"),
    ({"flag": 1}, "flag"),
    ({"optim": {"betas": [0.9, "x"]}}, "optim.betas[1]"),
    ({"optim": {"unknown": 1}}, "optim.unknown"),
    ({"optim": 3}, "optim"),
    ({"optim": {"steps": 0}}, "optim.steps"),  # validate()
])
def test_bad_types_name_key(data, key):
    with pytest.raises(ConfigError) as info:
        from_dict(Recipe, data)
    assert f"'{key}'" in str(info.value) and "\n" not in str(info.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(RlttError, match="nope.yaml"):
        load_recipe(Recipe, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(RlttError, match="bad.yaml"):
        load_recipe(Recipe, bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n")
    with pytest.raises(RlttError, match="mapping"):
        load_recipe(Recipe, listy)


def test_error_names_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("optim: {lr: fast}\n")
    with pytest.raises(ConfigError, match=r"r\.yaml.*optim\.lr"):
        load_recipe(Recipe, path)


def test_round_trip():
    r = load_recipe(Recipe, None, ["optim.steps=3", "maybe.path=q"])
    again = from_dict(Recipe, to_dict(r))
    assert again == r


def test_apply_overrides_does_not_mutate():
    base = {"optim": {"lr": 1.0}}
    out = apply_overrides(Recipe, base, ["optim.lr=2"])
    assert base == {"optim": {"lr": 1.0}} and out["optim"]["lr"] == 2.0
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(Recipe, base, ["optim.lr"])
