"""bench/compute.py: every run is a valid recipe with its price and sampled exits, the goal and the table
read what they should, and the smoke mode trains, evaluates, prints the table and resumes."""

import json
import math

import pytest

from tests.bench.helpers import load_bench
from tests.orchestration.helpers import tiny_checkpoint

from rltt.orchestration.train_recipe import load_train_recipe


def _load():
    return load_bench("compute")


def test_every_run_is_a_valid_recipe_with_its_price(tmp_path):
    bench = _load()
    args = bench.parse_args(["--out", str(tmp_path), "--lambdas", "0.3,0.1", "--seeds", "2"])
    assert args.lambdas == (0.0, 0.1, 0.3)  # the baseline is always run
    runs = bench.build_runs(args)
    assert [(r.lam, r.seed) for r in runs] == [(lam, s) for lam in (0.0, 0.1, 0.3) for s in (0, 1)]
    for run in runs:
        recipe = load_train_recipe(bench.RECIPE, run.train_argv[2:])
        assert recipe.algorithm.compute_cost == run.lam and recipe.rollout.exit_policy == "sample"
        assert recipe.algorithm.exit_action
        assert recipe.rollout.schedule == "deferred" and recipe.seed == run.seed and recipe.train.steps == 150
        assert run.eval_argv[:2] == ["eval", bench.RECIPE] and "--out" in run.eval_argv
        assert run.eval_argv[run.eval_argv.index("--model") + 1].endswith("checkpoints/step-0000150")
    with pytest.raises(SystemExit):
        bench.parse_args(["--lambdas", "-0.1"])
    off = bench.build_runs(bench.parse_args(["--out", str(tmp_path), "--no-exit-action"]))
    assert not load_train_recipe(bench.RECIPE, off[0].train_argv[2:]).algorithm.exit_action
    # --compute-price: the priced runs only (at λ = 0 the setting changes nothing)
    priced = bench.build_runs(bench.parse_args(["--lambdas", "0.1", "--seeds", "1", "--out", str(tmp_path),
                                                "--compute-price", "advantage"]))
    prices = [load_train_recipe(bench.RECIPE, r.train_argv[2:]).algorithm.compute_price for r in priced]
    assert prices == ["reward", "advantage"] and not any("compute_price" in a for a in priced[0].train_argv)


def _result(exit_end, diff=None):
    nan = float("nan")
    r = {"seeds": 2, "pass1": 0.4, "pass1_se": 0.02, "exit_start": 2.5, "exit_end": exit_end, "ppt_start": 2.6,
         "ppt_end": exit_end + 0.1, "tok_s_first": 900.0, "tok_s_last": 1100.0, "train_exit_first": 2.5,
         "train_exit_last": exit_end, "penalty_last": 0.05, "pass1_diff": nan}
    if diff is not None:
        r["diff"] = {"mean": diff[0], "se": diff[1], "p_value": 0.3}
    return r


@pytest.mark.parametrize("exit_end, diff, verdict", [
    (1.8, (-0.03, 0.02), "met (exit −28 %)"),  # 28 % fewer loops, 1.5 SE worse: within 2 SE
    (2.2, (0.0, 0.02), "missed: exit −12 % < 25 %"),
    (1.5, (-0.10, 0.02), "missed: solve rate -5.0 SE"),
])
def test_goal_reads_the_exit_fall_and_the_solve_rate_in_standard_errors(exit_end, diff, verdict):
    bench = _load()
    assert bench.goal(_result(exit_end, diff), _result(2.5)) == verdict


def test_table_has_one_row_per_price():
    bench = _load()
    results = {0.0: _result(2.5), 0.3: {**_result(1.8, (-0.03, 0.02)), "goal": "met (exit −28 %)"},
               1.0: {"seeds": 0}}
    table = bench.format_table(results, 150, 4)
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 4 and "held-out pass@1 (150 steps, 4 samples)" in rows[0]
    assert "| 0 | 2 | 0.400 ± 0.020 | (baseline) | 2.50 → 2.50 |" in rows[1]
    assert "-3.0 ± 2.0 (p 0.3)" in rows[2] and "900 → 1100" in rows[2] and "met (exit −28 %)" in rows[2]
    assert rows[3] == "| 1 | 0 | failed | | | | | | | |"
    assert bench.mean_se([1.0, 3.0]) == (2.0, 1.0) and math.isnan(bench.mean_se([1.0])[1])


@pytest.mark.slow  # two `rltt train` and two `rltt eval` subprocesses, then a rerun
def test_smoke_mode_trains_evaluates_and_resumes(tmp_path, capsys):
    bench = _load()
    model = tiny_checkpoint(tmp_path / "model", num_loops=3)
    out = tmp_path / "out"
    assert bench.main(["--smoke", "--out", str(out), "--model", str(model)]) == 0
    report = json.loads((out / "compute.json").read_text())
    assert [(r["lambda"], r["error"]) for r in report["runs"]] == [(0.0, ""), (0.5, "")]
    for run in report["runs"]:
        assert run["steps"] == 2 and 0.0 <= run["solve_end"] <= 1.0 and 1.0 <= run["exit_end"] <= 3.0
        assert run["ppt_end"] > 0 and run["tok_s_last"] > 0
    assert report["runs"][0]["penalty_last"] == 0.0 and 0 < report["runs"][1]["penalty_last"] <= 0.5
    assert "diff" in report["results"]["0.5"] and "goal" in report["results"]["0.5"]
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 6 and "mean exit step" in rows[0] and "tokens per CPU s" in rows[3]
    # the same-process speed check: each price's final checkpoint rolled out on the same prompts
    speed = report["speed"]
    assert set(speed) == {"0", "0.5"} and rows[4].startswith("| 0 |") and rows[4].endswith("| 1.00 |")
    for r in speed.values():
        assert r["tokens"] > 0 and r["tok_per_cpu_s"] > 0 and 1.0 <= r["mean_exit"] <= 3.0
        assert 1.0 <= r["passes_per_token"] <= 3.0 + 1e-9 and r["passes"] >= 1
    log = (out / "lam0.5-s0.log").read_text()
    assert log.startswith("rltt train recipes/quickstart.yaml rollout.exit_policy=sample algorithm.exit_action=true "
                          "algorithm.compute_cost=0.5")
    # a rerun reuses the finished runs; a run whose evaluation is missing is only evaluated
    (out / "lam0-s0" / "eval.json").unlink()
    assert bench.main(["--smoke", "--out", str(out), "--model", str(model)]) == 0
    err = capsys.readouterr().err
    assert "lam0.5-s0: reused" in err and "lam0-s0: reused" not in err
    assert (out / "lam0-s0.log").read_text().count("rltt train ") == 1
    assert json.loads((out / "compute.json").read_text())["runs"][0]["solve_end"] == report["runs"][0]["solve_end"]


def test_a_run_stopped_after_a_checkpoint_is_resumable(tmp_path):
    """A training run killed after its first RL checkpoint is continued (``--resume``), not restarted:
    its checkpoints are found by the RL loop's state file."""
    bench = _load()
    run = bench.build_runs(bench.parse_args(["--lambdas", "0.1", "--seeds", "1", "--out", str(tmp_path)]))[1]
    assert not bench.resumable(run)
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    step = run.run_dir / "checkpoints" / "step-0000025"
    step.mkdir(parents=True)
    assert not bench.resumable(run)  # no loop state: not a complete RL checkpoint
    from rltt.orchestration.saver import STATE_FILE

    (step / STATE_FILE).write_bytes(b"")
    assert bench.resumable(run) and not bench.trained(run, 150)
