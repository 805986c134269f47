"""bench/lora_quickstart.py's report, on runs written here (no training): an arm's gain on a seed is
its pass@1 less that seed's base, unfinished seeds are left out, and two arms of several runs are
compared with whole runs permuted."""

import json

import pytest

from rltt.evaluation.results import ProblemCounts, result_object
from rltt.telemetry import MetricsLogger

from .helpers import load_bench

PROBLEMS = 40


def _eval(path, correct: int) -> None:
    """A result with ``correct`` of the problems solved on both of 2 samples, the rest on none."""
    counts = ProblemCounts([f"p{i}" for i in range(PROBLEMS)], [2] * PROBLEMS,
                           [2 if i < correct else 0 for i in range(PROBLEMS)])
    path.write_text(json.dumps(result_object({"model": str(path.parent)}, counts, reps=50)))


def _run(out, arm: str, seed: int, correct: int, step_time: float) -> None:
    run = out / f"{arm}-s{seed}"
    run.mkdir(parents=True)
    with MetricsLogger(run) as log:
        for step in range(1, 13):
            log.log(step, {"time/step": step_time, "time/rollout": step_time / 2, "time/learner": step_time / 2,
                           "memory/peak_gb": 0.5 + seed / 10, "kl/ref": 0.01 * step})
    (run / "train_wall_s").write_text("100.0\n")
    _eval(run / "eval.json", correct)


def test_gains_are_per_seed_against_that_seeds_base(tmp_path, capsys):
    bench = load_bench("lora_quickstart")
    for seed, base in enumerate((10, 12, 14)):
        _eval(tmp_path / f"base-s{seed}.eval.json", base)
        _run(tmp_path, "shared", seed, base + 4, 1.0)  # +10 points: 4 more of 40 problems
        _run(tmp_path, "full", seed, base + 4 * seed, 2.0)  # +0, +10, +20
    (tmp_path / "shared-s3").mkdir()  # a seed not finished: no eval.json, left out
    rows = {arm: bench.arm_rows(arm, [0, 1, 2, 3], tmp_path) for arm in ("shared", "full", "perloop")}
    assert rows["perloop"] is None
    assert rows["shared"]["seeds"] == [0, 1, 2] and rows["shared"]["gains"] == pytest.approx([10.0] * 3)
    assert rows["full"]["gains"] == pytest.approx([0.0, 10.0, 20.0]) and rows["full"]["mean"] == pytest.approx(10.0)
    assert rows["full"]["se"] == pytest.approx(10 / 3**0.5)
    assert rows["full"]["step"] == 2.0 and rows["shared"]["peak_gb"] == 0.7
    assert rows["shared"]["kl"] == pytest.approx(0.075)  # the last 10 of 12 steps' kl/ref, averaged
    comparison = bench.compare("shared", "full", [0, 1, 2], tmp_path)
    assert comparison["test"] == "runs" and comparison["a"]["runs"] == comparison["b"]["runs"] == 3
    bench.report(["shared", "full"], [0, 1, 2], tmp_path)
    table = capsys.readouterr().out
    assert "| shared | 200 | 3 | +10.0 +10.0 +10.0 | **+10.0 ± 0.0**" in table and "| shared − full | 3 vs 3 (runs)" in table
