"""Reward functions from spec strings (no runner, no worker processes: both import this).

A reward function is ``fn(completion: str, answer: str, **kw) -> float``. Recipes name one
by a spec string:

- ``"rewards/gsm8k.py:strict"`` — a Python file and a function in it; a relative path is
  looked up under ``root`` (default: the current directory), then under the rltt source
  checkout; if no file is found, ``rewards/NAME.py`` falls back to the installed module
  ``rewards.NAME``;
- ``"rewards.gsm8k:strict"`` — an importable module and a function in it.

:func:`builtin_reward` marks a function shipped with rltt as known-safe (it may run in the
trainer's process); `rltt.data.rewards.RewardRunner` applies the functions, isolated in worker
processes (`rltt.data.reward_pool`) otherwise.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

from rltt.errors import RlttError

RewardFn = Callable[..., float]

# the directory holding the rltt package (a source checkout has rewards/ beside it)
_PROJECT_ROOT = Path(__file__).resolve().parents[2]
_FILE_MODULES: dict[Path, ModuleType] = {}


def _split_spec(spec: str) -> tuple[str, str]:
    target, sep, name = spec.rpartition(":")
    # "C:\\x\\r.py:fn" keeps the drive colon in target; a spec needs a non-empty function name
    if not sep or not target or not name or not name.isidentifier():
        raise RlttError(f"bad reward spec '{spec}': expected FILE.py:FUNCTION or module.path:FUNCTION")
    return target, name


def _load_file_module(path: Path) -> ModuleType:
    path = path.resolve()
    if path in _FILE_MODULES:
        return _FILE_MODULES[path]
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"rltt_reward_{stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RlttError(f"reward file cannot be imported: {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except RlttError:
        raise
    except Exception as exc:
        del sys.modules[module_name]
        raise RlttError(f"reward file {path} failed to import: {type(exc).__name__}: {exc}") from None
    _FILE_MODULES[path] = module
    return module


def _import_module(name: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):  # the module itself (or a parent) is missing
            raise RlttError(f"reward spec '{spec}': no module '{name}'") from None
        raise RlttError(f"reward module '{name}' failed to import: {exc}") from None
    except Exception as exc:
        raise RlttError(f"reward module '{name}' failed to import: {type(exc).__name__}: {exc}") from None


def _resolve_module(target: str, spec: str, root: Path | None) -> ModuleType:
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser()
        candidates = [path] if path.is_absolute() else [(root or Path.cwd()) / path, _PROJECT_ROOT / path]
        for candidate in candidates:
            if candidate.is_file():
                return _load_file_module(candidate)
        parts = Path(target).with_suffix("").parts
        if not path.is_absolute() and len(parts) == 2 and parts[0] == "rewards":
            try:  # an installed rltt: rewards/ is a package, not a folder on disk
                return importlib.import_module(f"rewards.{parts[1]}")
            except ImportError:
                pass
        raise RlttError(
            f"reward file not found: {target} (from spec '{spec}'; looked in "
            + ", ".join(str(c.parent) for c in dict.fromkeys(candidates))
            + ")"
        )
    return _import_module(target, spec)


def load_reward_fn(spec: str, root: str | Path | None = None) -> RewardFn:
    """The reward function a spec string names (see the module docstring)."""
    target, name = _split_spec(spec)
    module = _resolve_module(target, spec, Path(root) if root is not None else None)
    fn = getattr(module, name, None)
    if fn is None:
        available = sorted(
            k for k, v in vars(module).items() if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise RlttError(
            f"reward spec '{spec}': no function '{name}' in {target} (it defines: {', '.join(available) or 'nothing'})"
        )
    if not callable(fn):
        raise RlttError(f"reward spec '{spec}': '{name}' in {target} is not a function")
    return fn


def builtin_reward(fn: RewardFn) -> RewardFn:
    """Mark a reward function shipped with rltt as known-safe: it runs in the trainer's process
    (no worker round-trip). Honoured only for functions defined in rltt's own ``rewards/`` or
    ``rltt/`` files, so a user's copy of a built-in file is isolated like any user reward."""
    fn.__rltt_builtin__ = True
    return fn


def _trusted_roots() -> list[Path]:
    return [(_PROJECT_ROOT / "rewards").resolve(), Path(__file__).resolve().parents[1]]


def is_builtin(fn: RewardFn) -> bool:
    """True for a :func:`builtin_reward` defined in rltt's own files."""
    if not getattr(fn, "__rltt_builtin__", False):
        return False
    try:
        source = Path(inspect.getsourcefile(fn) or "").resolve()
    except TypeError:
        return False
    return any(root in source.parents for root in _trusted_roots())


def reward_name(spec: str) -> str:
    """A short display name for a spec: ``"rewards/gsm8k.py:strict"`` -> ``"gsm8k.strict"``."""
    target, name = _split_spec(spec)
    stem = Path(target).stem if (target.endswith(".py") or "/" in target) else target.rsplit(".", 1)[-1]
    return f"{stem}.{name}"
