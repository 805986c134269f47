"""rltt.config: typed recipes from YAML with dotted overrides and one-line errors."""

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import pytest

from rltt.config import (PositiveFloat, PositiveInt, Range, apply_overrides, check_fields, from_dict, load_recipe,
                         recipe_error, to_dict)
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


# --------------------------------------------------------------------------- declared constraints

@dataclass
class Ranged:
    RENAMED: ClassVar[dict] = {"old_lr": "lr", "sec.old": "sec.new"}
    lr: PositiveFloat = 1e-3
    n: PositiveInt = 1
    p: Annotated[float, Range(gt=0, le=1, why="a probability")] = 0.5
    cap: PositiveFloat | None = None
    xs: list[Annotated[int, Range(ge=0)]] = field(default_factory=list)


@pytest.mark.parametrize("override, key, words", [
    ("lr=0", "lr", "> 0"), ("lr=-1", "lr", "> 0"), ("lr=nan", "lr", "finite"), ("lr=inf", "lr", "finite"),
    ("n=0", "n", ">= 1"), ("p=1.5", "p", "a probability"), ("cap=-2", "cap", "> 0"), ("xs=[1, -1]", "xs[1]", ">= 0"),
    ("lr=1e400", "lr", "finite"),
])
def test_declared_ranges_are_checked_at_load(override, key, words):
    with pytest.raises(ConfigError) as info:
        load_recipe(Ranged, None, [override])
    msg = str(info.value)
    assert f"recipe key '{key}'" in msg and words in msg and "\n" not in msg


def test_declared_ranges_pass_good_values():
    r = load_recipe(Ranged, None, ["lr=2", "n=3", "p=1", "cap=null", "xs=[0, 5]"])
    assert r.lr == 2.0 and r.n == 3 and r.p == 1.0 and r.cap is None and r.xs == [0, 5]


def test_huge_int_for_a_float_field_is_an_error_not_overflow():
    with pytest.raises(ConfigError, match="'lr'.*finite"):
        from_dict(Ranged, {"lr": 10**400})


def test_renamed_keys_in_overrides_and_data():
    with pytest.raises(ConfigError, match=r"^recipe key 'old_lr' was renamed to 'lr'$"):
        load_recipe(Ranged, None, ["old_lr=1"])
    with pytest.raises(ConfigError, match=r"recipe key 'sec.old' was renamed to 'sec.new'"):
        load_recipe(Ranged, None, data={"sec": {"old": 1}})


def test_check_fields_for_directly_built_sections():
    @dataclass
    class Section:
        lr: PositiveFloat = 1.0
        kind: Literal["a", "b"] = "a"

        def __post_init__(self):
            check_fields(self, "sec")

    assert Section(lr=2).lr == 2.0 and isinstance(Section(lr=2).lr, float)
    with pytest.raises(ConfigError, match="'sec.lr'"):
        Section(lr=float("nan"))
    with pytest.raises(ConfigError, match="'sec.kind'"):
        Section(kind="c")


def test_literal_of_ints_rejects_bools_and_strings():
    @dataclass
    class Z:
        stage: Literal[0, 1, 2, 3] = 0

    assert load_recipe(Z, None, ["stage=2"]).stage == 2
    for bad in ({"stage": True}, {"stage": "2"}, {"stage": 4}):
        with pytest.raises(ConfigError, match="'stage'"):
            from_dict(Z, bad)


def test_non_utf8_and_empty_files(tmp_path):
    raw = tmp_path / "raw.yaml"
    raw.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(RlttError, match=r"raw\.yaml: not UTF-8 text \(byte 0xff at offset 6\)"):
        load_recipe(Recipe, raw)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(RlttError, match=r"empty\.yaml: the recipe is empty"):
        load_recipe(Recipe, empty)


def test_error_messages_stay_one_line_for_multiline_values():
    with pytest.raises(ConfigError) as info:
        load_recipe(Recipe, None, ["optim.kind=a\nb"])
    assert "\n" not in str(info.value)
