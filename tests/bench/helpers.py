"""Shared by the bench tests: load a `bench/` script or package (bench/ itself is not a package) as a module."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_bench(name: str):
    """``bench/<name>.py``, or the package ``bench/<name>/``, as a fresh module registered under
    ``name`` (its dataclasses look their module up while it loads); a package's modules load
    afresh too, as ``name.<module>``."""
    package = ROOT / "bench" / name / "__init__.py"
    if package.is_file():
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded]
        spec = importlib.util.spec_from_file_location(name, package, submodule_search_locations=[str(package.parent)])
    else:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
