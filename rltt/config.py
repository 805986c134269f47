"""Typed recipes: dataclass schemas loaded from YAML, with ``key=value`` dotted overrides.

Every recipe family (``train``/``curate``/``eval``, ``pretrain``, ``convert``) is declared the
same way, and every value is checked once, at load, before any model loads or file is written:

- **the field's type**: ``int``, ``float``, ``bool``, ``str``, ``Literal[...]`` (the choices),
  ``X | None``, ``list[X]``, ``dict[str, X]``, ``Any`` or another dataclass;
- **the field's range**, declared next to its type: ``Annotated[float, Range(gt=0)]``
  (aliases such as :data:`PositiveFloat`, :data:`NonNegativeInt`, :data:`Fraction`). Every
  ``float`` must be finite (nan/inf are rejected) unless ``Range(finite=False)``;
- ``validate(self)`` on a section only for what one field cannot say alone: relations between
  fields or sections, files that must exist, the machine (``model.device=cuda`` without a GPU).

Errors are one line naming the dotted key (``recipe key 'rollout.top_p': must be <= 1, got
2.0``) and, for a file, the file. A schema lists keys it used to have in ``RENAMED``
(``{"output_dir": "logging.run_dir"}``): using one is a one-line "was renamed to" error::

    from dataclasses import dataclass, field
    from typing import ClassVar
    from rltt.config import NonNegativeInt, PositiveFloat, load_recipe

    @dataclass
    class Optim:
        lr: PositiveFloat = 1e-3
        warmup_steps: NonNegativeInt = 0

    @dataclass
    class Recipe:
        RENAMED: ClassVar[dict[str, str]] = {"optim.learning_rate": "optim.lr"}
        optim: Optim = field(default_factory=Optim)

    recipe = load_recipe(Recipe, "recipe.yaml", ["optim.lr=3e-4"])

Overrides are coerced to the field's type (``optim.warmup_steps=10`` gives an int,
``flag=true`` a bool, ``x=null`` None where allowed; lists/dicts/``Any`` are parsed as YAML).
A dotted key may reach into a ``dict`` field (``model.config.hidden_size=64``).
:func:`to_dict` turns a recipe back into plain YAML-able data (saved with checkpoints).
Sections also built directly in code (``AlgorithmConfig(...)``) call :func:`check_fields`
from ``__post_init__``, so they obey the same declared constraints.

Why this small dataclass loader and not pydantic: the recipes are plain dataclasses used all
over the code (``dataclasses.replace``, ``fields``, direct construction in tests and
benchmarks); the loader is this one module with no dependency, its overrides are typed by the
schema (``seed=7`` is an int, ``name=123`` stays a str) and its errors already name the
dotted key. Pydantic v2 (``extra="forbid"``) would give the same checks but turn every
section into a ``BaseModel``, need its ``ValidationError`` translated back into one-line
dotted-key errors, and still need this override parser; the field-declared ``Range`` /
``Literal`` constraints keep the one-style property without that migration.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Mapping, TypeVar

import yaml

from rltt.errors import ConfigError, RlttError

__all__ = [
    "Fraction",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PositiveFloat",
    "PositiveInt",
    "Range",
    "apply_overrides",
    "check_fields",
    "from_dict",
    "load_recipe",
    "load_yaml",
    "recipe_error",
    "renamed_error",
    "to_dict",
]

T = TypeVar("T")


def recipe_error(key: str, message: str) -> ConfigError:
    """A one-line error about recipe key ``key`` (dotted)."""
    message = " ".join(str(message).splitlines()) or "invalid value"
    return ConfigError(f"recipe key '{key}': {message}" if key else f"recipe: {message}")


# --------------------------------------------------------------------------- constraints


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric range declared on a field: ``Annotated[float, Range(gt=0, le=1)]``.

    ``why`` is appended to the error (``"group size 1 can never learn"``). ``finite=False``
    lets a float field hold inf/nan (none does today).
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""
    finite: bool = True

    def check(self, value: Any, key: str) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return
        for bound, ok, word in ((self.ge, lambda b: value >= b, ">="), (self.gt, lambda b: value > b, ">"),
                                (self.le, lambda b: value <= b, "<="), (self.lt, lambda b: value < b, "<")):
            if bound is not None and not ok(bound):
                raise recipe_error(key, f"must be {self.describe()}, got {value!r}" + (f" ({self.why})" if self.why else ""))

    def describe(self) -> str:
        parts = [f"{w} {b:g}" for b, w in ((self.ge, ">="), (self.gt, ">"), (self.le, "<="), (self.lt, "<"))
                 if b is not None]
        return " and ".join(parts)


PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]
Fraction = Annotated[float, Range(ge=0, le=1)]


# --------------------------------------------------------------------------- types


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _split_annotated(tp: Any) -> tuple[Any, tuple]:
    """``(base type, metadata)`` of ``Annotated[base, *metadata]`` (``(tp, ())`` otherwise)."""
    if typing.get_origin(tp) is Annotated:
        base, *meta = typing.get_args(tp)
        return base, tuple(meta)
    return tp, ()


def _base(tp: Any) -> Any:
    return _split_annotated(tp)[0]


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _type_name(tp: Any) -> str:
    tp, meta = _split_annotated(tp)
    ranges = [m.describe() for m in meta if isinstance(m, Range) and m.describe()]
    if ranges:
        return f"{_type_name(tp)} {' and '.join(ranges)}"
    if tp is Any:
        return "any value"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + " | ".join(repr(a) for a in typing.get_args(tp))
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` checked against (and lightly converted to) type ``tp``; errors name ``key``."""
    tp, meta = _split_annotated(tp)
    value = _coerce_base(value, tp, key)
    finite = all(m.finite for m in meta if isinstance(m, Range))
    if finite and isinstance(value, float) and not math.isfinite(value):
        raise recipe_error(key, f"must be a finite number, got {value!r}")
    for m in meta:
        if isinstance(m, Range):
            m.check(value, key)
    return value


def _coerce_base(value: Any, tp: Any, key: str) -> Any:
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, key)
    origin = typing.get_origin(tp)
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise recipe_error(key, f"expected {_type_name(tp)}, got null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise recipe_error(key, f"expected {_type_name(tp)}, got {_shown(value)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise recipe_error(key, f"must be one of {' | '.join(map(str, allowed))}, got {_shown(value)}")
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise recipe_error(key, f"expected a list, got {_shown(value)}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        items = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise recipe_error(key, f"expected a mapping, got {_shown(value)}")
        args = typing.get_args(tp)
        item = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, item, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise recipe_error(key, f"must be a finite number, got {_shown(value)}") from None
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise recipe_error(key, f"expected {_type_name(tp)}, got {type(value).__name__} {_shown(value)}")


def check_fields(obj: Any, where: str) -> None:
    """Check (and lightly convert) the fields of a directly built section ``obj`` against their
    declared types and ranges; errors name ``where.field``. Call it from ``__post_init__``."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            continue
        object.__setattr__(obj, f.name, _coerce(value, hints[f.name], f"{where}.{f.name}" if where else f.name))


# --------------------------------------------------------------------------- building


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, checking keys, types and ranges recursively.

    ``where`` is the dotted prefix used in error messages. Missing keys take the field
    defaults; a field without a default is required. Calls ``validate()`` when defined.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise recipe_error(where, f"expected a mapping, got {type(data).__name__} {_shown(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    for key in data:
        if key not in fields:
            dotted = f"{where}.{key}" if where else str(key)
            raise recipe_error(dotted, f"unknown key (known: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        dotted = f"{where}.{name}" if where else name
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], dotted)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise recipe_error(dotted, "is required")
    try:
        obj = cls(**kwargs)
    except RlttError:
        raise
    except (TypeError, ValueError) as exc:
        raise recipe_error(where, str(exc)) from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) from a recipe dataclass, for saving as YAML/JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


# --------------------------------------------------------------------------- renamed keys


def renamed_error(cls: type, key: str) -> ConfigError | None:
    """The "was renamed" error for dotted ``key`` (or a key under it) if schema ``cls`` lists it."""
    for old, new in getattr(cls, "RENAMED", {}).items():
        if key == old or key.startswith(old + "."):
            return ConfigError(f"recipe key '{old}' was renamed to '{new}'")
    return None


def _check_renamed(cls: type, data: Mapping, where: str = "") -> None:
    for key, value in data.items():
        dotted = f"{where}.{key}" if where else str(key)
        error = renamed_error(cls, dotted)
        if error is not None:
            raise error
        if isinstance(value, Mapping):
            _check_renamed(cls, value, dotted)


# --------------------------------------------------------------------------- overrides


def _parse_scalar(text: str, tp: Any, key: str) -> Any:
    """An override's text parsed for a field of type ``tp`` (then checked by ``_coerce``)."""
    tp = _base(tp)
    stripped = text.strip()
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if stripped.lower() in ("null", "none", "~") and len(args) < len(typing.get_args(tp)):
            return None
        if len(args) == 1:
            return _parse_scalar(text, args[0], key)
        return _yaml_value(text, key)
    if tp is str:
        return text
    if typing.get_origin(tp) is Literal:
        allowed = typing.get_args(tp)
        if all(isinstance(a, str) for a in allowed):
            return text
        return _yaml_value(text, key)
    if tp is bool:
        lowered = stripped.lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        raise recipe_error(key, f"expected a bool (true/false), got {_shown(text)}")
    if tp is int:
        try:
            return int(stripped.replace("_", ""))
        except ValueError:
            try:
                as_float = float(stripped)
            except ValueError:
                raise recipe_error(key, f"expected an int, got {_shown(text)}") from None
            if as_float.is_integer():
                return int(as_float)
            raise recipe_error(key, f"expected an int, got {_shown(text)}") from None
    if tp is float:
        try:
            return float(stripped)
        except ValueError:
            raise recipe_error(key, f"expected a float, got {_shown(text)}") from None
    return _yaml_value(text, key)


def _yaml_value(text: str, key: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise recipe_error(key, f"cannot parse override value {_shown(text)}") from None


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside ``tp`` (``X`` or ``X | None``), if any."""
    tp = _base(tp)
    if dataclasses.is_dataclass(tp):
        return tp
    if _is_union(tp):
        found = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return found[0] if len(found) == 1 else None
    return None


def _is_mapping_type(tp: Any) -> bool:
    tp = _base(tp)
    if tp is dict or typing.get_origin(tp) is dict or tp is Any:
        return True
    return _is_union(tp) and any(_is_mapping_type(a) for a in typing.get_args(tp) if a is not type(None))


def apply_overrides(cls: type, data: Mapping | None, overrides: Iterable[str]) -> dict:
    """A copy of ``data`` with ``key=value`` overrides applied, typed by schema ``cls``.

    Unknown (or renamed) keys and unparsable values raise :class:`ConfigError` naming the key.
    """
    result: dict = _deep_copy(dict(data or {}))
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {_shown(item)} is not of the form key=value")
        error = renamed_error(cls, key)
        if error is not None:
            raise error
        parts = key.split(".")
        node, schema = result, cls
        for depth, part in enumerate(parts):
            dotted = ".".join(parts[: depth + 1])
            last = depth == len(parts) - 1
            if not part:
                raise ConfigError(f"override {_shown(item)}: empty part in key '{key}'")
            if schema is None:  # inside a free-form mapping
                if last:
                    node[part] = _yaml_value(text, key)
                else:
                    child = node.get(part)
                    if not isinstance(child, dict):
                        child = node[part] = {}
                    node = child
                continue
            names = {f.name for f in dataclasses.fields(schema) if f.init}
            if part not in names:
                raise recipe_error(dotted, f"unknown key (known: {', '.join(sorted(names))})")
            tp = _hints(schema)[part]
            if last:
                node[part] = _parse_scalar(text, tp, key)
                break
            inner = _dataclass_of(tp)
            if inner is None and not _is_mapping_type(tp):
                raise recipe_error(dotted, f"is {_type_name(tp)}, it has no sub-key '{parts[depth + 1]}'")
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node, schema = child, inner
    return result


def _deep_copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


# --------------------------------------------------------------------------- files


def load_yaml(path: str | Path) -> dict:
    """The top-level mapping of a recipe file; a missing, non-UTF-8, malformed or empty file is
    a one-line error naming it."""
    path = Path(path)
    if not path.is_file():
        raise RlttError(f"recipe file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RlttError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise RlttError(f"{path}{where}: {' '.join(str(problem).splitlines())}") from None
    if data is None:
        raise RlttError(f"{path}: the recipe is empty (write at least one section, e.g. 'train: {{steps: 10}}')")
    if not isinstance(data, dict):
        raise RlttError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def load_recipe(cls: type[T], path: str | Path | None = None, overrides: Iterable[str] = (),
                data: Mapping | None = None) -> T:
    """Load schema ``cls`` from a YAML file (or ``data``), apply overrides, check, validate."""
    base = load_yaml(path) if path is not None else dict(data or {})
    try:
        _check_renamed(cls, base)
        return from_dict(cls, apply_overrides(cls, base, list(overrides)))
    except ConfigError as exc:
        if path is not None:
            raise ConfigError(f"{path}: {exc}") from None
        raise
