"""Shared by the bench tests: load a `bench/` script (not a package) as a module."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_bench(name: str):
    """``bench/<name>.py`` as a fresh module, registered under ``name`` (its dataclasses look
    their module up while it loads)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
