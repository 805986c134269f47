"""Names that mean one thing are defined once in ``rltt`` (the others import them), and removed
names stay removed."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rltt"

#: a name -> the one module that defines it (a module-level assignment or def)
ONCE = {
    "GIB": "rltt/telemetry/schema.py",
    "RESOLVED_RECIPE": "rltt/telemetry/metrics_file.py",
    "EVAL_SEED_OFFSET": "rltt/orchestration/evaluator.py",
    "read_config": "rltt/model/model_source.py",
    "sampling_params": "rltt/orchestration/policy.py",
}
GONE = ("BACKENDS@rltt/orchestration/orchestration_section.py", "SYNCS@rltt/orchestration/orchestration_section.py",
        "ks_to_report@rltt/evaluation/passk.py", "sampled_lengths@rltt/data/reasoning.py", "_MISSING@rltt/config.py")


def definitions() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                continue
            for name in names:
                out.setdefault(name, []).append(str(path.relative_to(ROOT.parent)))
    return out


def test_shared_names_are_defined_once():
    found = definitions()
    assert {name: found.get(name) for name in ONCE} == {name: [where] for name, where in ONCE.items()}


def test_removed_names_stay_removed():
    found = definitions()
    assert [g for g in GONE if g.partition("@")[2] in found.get(g.partition("@")[0], [])] == []
