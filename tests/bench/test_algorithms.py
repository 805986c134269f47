"""bench/algorithms.py: its arms are the objective tables' entries, and the smoke mode runs every arm
(2 steps of `rltt train recipes/quickstart.yaml` on a tiny model) and prints the table."""

import json
import math

import pytest

from tests.bench.helpers import load_bench
from tests.orchestration.helpers import tiny_checkpoint

from rltt.objectives import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from rltt.orchestration.train_recipe import load_train_recipe


def _load():
    return load_bench("algorithms")


def test_every_arm_is_a_valid_recipe_of_the_tables(tmp_path):
    bench = _load()
    args = bench.parse_args(["--out", str(tmp_path)])
    runs = bench.build_runs(args)
    assert len(runs) == len(bench.ARMS) * 2 and {r.arm for r in runs} == set(bench.ARMS)
    seen = set()
    for run in runs:
        recipe = load_train_recipe(bench.RECIPE, run.argv[2:])
        algo = recipe.algorithm
        assert algo.loss in POLICY_LOSSES and algo.advantage in ADVANTAGE_ESTIMATORS
        assert recipe.train.steps == 250 and recipe.seed == run.seed
        seen.add((algo.loss, algo.advantage))
    assert seen == {("ppo_clip", "grpo"), ("gspo", "grpo"), ("cispo", "grpo"), ("ppo_clip", "rloo"),
                    ("ppo_clip", "reinforce_pp")}
    with pytest.raises(SystemExit):
        bench.parse_args(["--arms", "gspo"])  # the baseline is always measured


def test_table_reports_gain_with_its_standard_error():
    bench = _load()
    runs = [{"gain": g, "solve_end": 0.5, "train_solve_rate": 0.4, "step_seconds": s, "kl_median": 0.01,
             "clip_frac": 0.0} for g, s in ((0.10, 2.0), (0.20, 2.0))]
    agg = bench.aggregate(runs)
    assert agg["gain"] == pytest.approx(0.15) and agg["gain_se"] == pytest.approx(0.05)
    table = bench.format_table({bench.BASELINE: agg, "gspo": bench.aggregate(runs[:1])}, 250)
    assert "+15.0 ± 5.0" in table and "| gspo |" in table and "| 1.00 |" in table
    assert math.isnan(bench.aggregate(runs[:1])["gain_se"])


@pytest.mark.slow  # five `rltt train` subprocesses
def test_smoke_mode_runs_every_arm(tmp_path, capsys):
    bench = _load()
    model = tiny_checkpoint(tmp_path / "model", num_loops=3)
    out = tmp_path / "out"
    assert bench.main(["--smoke", "--out", str(out), "--model", str(model)]) == 0
    report = json.loads((out / "algorithms.json").read_text())
    assert {r["arm"] for r in report["runs"]} == set(bench.ARMS) and not any(r["error"] for r in report["runs"])
    for run in report["runs"]:
        assert run["steps"] == 2 and 0.0 <= run["solve_end"] <= 1.0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ")]  # the header and one row per arm
    assert len(rows) == len(bench.ARMS) + 1 and "held-out gain" in rows[0]
    assert (out / "gspo-s0.log").read_text().startswith("rltt train recipes/quickstart.yaml algorithm.loss=gspo")
