"""Typed recipes: dataclass schemas loaded from YAML, with ``key=value`` dotted overrides.

A recipe schema is a (nested) dataclass. Field types may be ``int``, ``float``, ``bool``,
``str``, ``Literal[...]``, ``X | None``, ``list[X]``, ``dict[str, X]``, ``Any`` or another
dataclass. Loading checks every key and type and raises a one-line
:class:`~rltt.errors.RlttError` naming the offending dotted key (or file) before any work
starts::

    from dataclasses import dataclass, field
    from rltt.config import load_recipe

    @dataclass
    class Optim:
        lr: float = 1e-3
        warmup_steps: int = 0

    @dataclass
    class Recipe:
        output_dir: str = "runs/x"
        optim: Optim = field(default_factory=Optim)

        def validate(self):              # optional: cross-field checks, file existence
            ...

    recipe = load_recipe(Recipe, "recipe.yaml", ["optim.lr=3e-4", "output_dir=/tmp/run"])

Overrides are coerced to the field's type (``optim.warmup_steps=10`` gives an int,
``flag=true`` a bool, ``x=null`` None where allowed; lists/dicts/``Any`` are parsed as YAML).
A dotted key may reach into a ``dict`` field (``model.config.hidden_size=64``).

Any dataclass in the tree may define ``validate(self)``; it is called bottom-up after
construction and should raise :func:`recipe_error` (or ``RlttError``) naming the key.
:func:`to_dict` turns a recipe back into plain YAML-able data (saved with checkpoints).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, TypeVar

import yaml

from rltt.errors import ConfigError, RlttError

__all__ = [
    "apply_overrides",
    "from_dict",
    "load_recipe",
    "load_yaml",
    "recipe_error",
    "to_dict",
]

T = TypeVar("T")
_MISSING = object()


def recipe_error(key: str, message: str) -> ConfigError:
    """A one-line error about recipe key ``key`` (dotted)."""
    return ConfigError(f"recipe key '{key}': {message}" if key else f"recipe: {message}")


# --------------------------------------------------------------------------- types


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=False)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _type_name(tp: Any) -> str:
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


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` checked against (and lightly converted to) type ``tp``; errors name ``key``."""
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
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
        raise recipe_error(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise recipe_error(key, f"must be one of {' | '.join(map(str, allowed))}, got {value!r}")
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise recipe_error(key, f"expected a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        items = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise recipe_error(key, f"expected a mapping, got {value!r}")
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
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise recipe_error(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


# --------------------------------------------------------------------------- building


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, checking keys and types recursively.

    ``where`` is the dotted prefix used in error messages. Missing keys take the field
    defaults; a field without a default is required. Calls ``validate()`` when defined.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise recipe_error(where, f"expected a mapping, got {type(data).__name__} {data!r}")
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
        raise recipe_error(where, str(exc).splitlines()[0]) from None
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


# --------------------------------------------------------------------------- overrides


def _parse_scalar(text: str, tp: Any, key: str) -> Any:
    """An override's text parsed for a field of type ``tp`` (then checked by ``_coerce``)."""
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
        raise recipe_error(key, f"expected a bool (true/false), got {text!r}")
    if tp is int:
        try:
            return int(stripped.replace("_", ""))
        except ValueError:
            try:
                as_float = float(stripped)
            except ValueError:
                raise recipe_error(key, f"expected an int, got {text!r}") from None
            if as_float.is_integer():
                return int(as_float)
            raise recipe_error(key, f"expected an int, got {text!r}") from None
    if tp is float:
        try:
            return float(stripped)
        except ValueError:
            raise recipe_error(key, f"expected a float, got {text!r}") from None
    return _yaml_value(text, key)


def _yaml_value(text: str, key: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise recipe_error(key, f"cannot parse override value {text!r}") from None


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside ``tp`` (``X`` or ``X | None``), if any."""
    if dataclasses.is_dataclass(tp):
        return tp
    if _is_union(tp):
        found = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return found[0] if len(found) == 1 else None
    return None


def _is_mapping_type(tp: Any) -> bool:
    if tp is dict or typing.get_origin(tp) is dict or tp is Any:
        return True
    return _is_union(tp) and any(_is_mapping_type(a) for a in typing.get_args(tp) if a is not type(None))


def apply_overrides(cls: type, data: Mapping | None, overrides: Iterable[str]) -> dict:
    """A copy of ``data`` with ``key=value`` overrides applied, typed by schema ``cls``.

    Unknown keys and unparsable values raise :class:`ConfigError` naming the key.
    """
    result: dict = _deep_copy(dict(data or {}))
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        parts = key.split(".")
        node, schema = result, cls
        for depth, part in enumerate(parts):
            dotted = ".".join(parts[: depth + 1])
            last = depth == len(parts) - 1
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
    """The top-level mapping of a YAML file; a missing or malformed file is a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise RlttError(f"recipe file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise RlttError(f"{path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RlttError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    return data


def load_recipe(cls: type[T], path: str | Path | None = None, overrides: Iterable[str] = (),
                data: Mapping | None = None) -> T:
    """Load schema ``cls`` from a YAML file (or ``data``), apply overrides, check, validate."""
    base = load_yaml(path) if path is not None else dict(data or {})
    try:
        return from_dict(cls, apply_overrides(cls, base, list(overrides)))
    except ConfigError as exc:
        if path is not None:
            raise ConfigError(f"{path}: {exc}") from None
        raise
