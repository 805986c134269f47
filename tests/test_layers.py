"""The import graph of ``rltt``: every import (module level or inside a function) points down
the layers, and no modules import each other in a circle.

The layers, lowest first. A package may import its own modules and any package listed before
it, never one after it: run infrastructure and telemetry know nothing of models, engines or
loops; the model knows no engine; engines know no learner; the learner knows no loop; the
LM-training stages know nothing of RL; only the CLI sees everything.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rltt"

LAYERS = [
    "errors",
    "config",        # typed recipes: YAML, overrides, one-line errors
    "evaluation",    # pass@k, bootstrap intervals, paired comparisons (numpy and errors only)
    "telemetry",     # metric names, the metrics file, sinks, statistics, review
    "runtime",       # checkpoints, the non-finite guard, paths, devices, ranks
    "kernels",       # per-loop log-prob kernels
    "objectives",    # losses and estimators
    "model",         # the looped model
    "rollout",       # the engine interface and the native engine
    "data",          # prompts, datasets, rewards
    "sections",      # recipe sections every family shares
    "environments",  # multi-turn environments, their tools and the tool sandbox
    "vllm",          # the vLLM engine and rltt's model inside vLLM
    "learner",       # the RL learner and its backends
    "lm_training",   # pretraining and dense-to-loop conversion
    "planning",      # the memory plan (from config.json and the recipe's values alone)
    "orchestration", # the RL loop, where its parts live, and evaluating a policy (train, eval, curate)
    "curation",      # solve-rate curation of a recipe's data
    "cli",
]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every ``rltt`` module ``path`` imports when it runs, anywhere in the file (``from a import
    b`` counts ``a.b`` when that is a module, else ``a``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):  # type-only imports (under ``if TYPE_CHECKING:``) never run
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "rltt"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "rltt":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if _exists(sub) else base)
    return found


def _exists(module: str) -> bool:
    path = ROOT.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = _module(path)
        out[module] = {m for m in _imports(path, module) if m != module}
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else None
    if name is None:
        return -1  # the package root (its version) sits below everything
    return LAYERS.index(name)


def test_every_package_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert tops == set(LAYERS)


def test_imports_point_down_the_layers():
    upward = [f"{src} -> {dst}" for src, targets in graph().items() for dst in sorted(targets)
              if _layer(dst) > _layer(src)]
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    edges = graph()
    # a package's __init__ re-exporting its modules is not a circle with them
    edges = {src: {dst for dst in targets if not src.startswith(dst + ".")} for src, targets in edges.items()}
    assert not _cycles(edges)


def test_the_checker_sees_a_circle_and_an_upward_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer("rltt.learner.learner") > _layer("rltt.runtime.distributed")


def test_no_two_modules_share_a_file_name():
    """Outside ``cli/`` (one module per command, named after it), a file name says which module."""
    names: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name != "__init__.py" and path.parent.name != "cli":
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
