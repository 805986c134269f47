"""The README's main job for real: recipes/quickstart.yaml from the quickstart model (built on
first use), a few steps, then `rltt review` on the run."""

import pytest

from rltt.cli.main import main
from rltt.telemetry import read_metrics

pytestmark = pytest.mark.slow


def test_quickstart_recipe_runs_and_is_reviewed(tmp_path, capsys):
    run_dir = tmp_path / "quickstart"
    code = main(["train", "recipes/quickstart.yaml", f"logging.run_dir={run_dir}", "train.steps=4",
                 "train.eval_every=4", "data.eval_size=16", "logging.progress=false", "checkpoint.every=2"])
    assert code == 0
    out = capsys.readouterr().out
    assert "held-out solve rate" in out and "health review" in out
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert 0.0 <= records[-1]["eval/solve_rate"] <= 1.0
    assert records[-1]["exit/p_4"] > 0.05  # the quickstart model's gate is not collapsed
    assert (run_dir / "review" / "report.md").exists() and (run_dir / "review" / "report.html").exists()
    # the review CLI reads the finished run too
    assert main(["review", str(run_dir), "--no-plots"]) == 0
