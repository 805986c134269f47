"""Result objects: per-problem counts in and out, pooling runs, comparing sides by problem id."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.errors import RlttError
from rltt.evaluation.results import ProblemCounts, compare_object, pool_object, result_object, result_files


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 64), st.lists(st.integers(0, 64), min_size=1, max_size=10))
def test_counts_survive_the_round_trip_through_rates(samples, raw):
    correct = [min(c, samples) for c in raw]
    rates = {f"p{i}": c / samples for i, c in enumerate(correct)}
    counts = ProblemCounts.from_rates(rates, samples)
    assert counts.c.tolist() == correct and counts.n.tolist() == [samples] * len(correct)


def write(path, ids, n, c):
    obj = result_object({"model": path.stem}, ProblemCounts(ids, n, c), reps=50)
    path.write_text(json.dumps(obj))
    return obj


def test_result_object_summary_and_problems(tmp_path):
    obj = write(tmp_path / "r.json", ["a", "b", "c"], [4, 4, 4], [0, 2, 4])
    assert list(obj["summary"]) == ["pass@1", "pass@2", "pass@3", "pass@4", "mean@4"]
    assert obj["summary"]["pass@1"]["mean"] == pytest.approx(0.5)
    assert obj["summary"]["pass@4"]["mean"] == pytest.approx(2 / 3)  # b: 1 − C(2,4)/C(4,4) = 1
    assert obj["summary"]["pass@2"]["mean"] == pytest.approx((0 + (1 - 1 / 6) + 1) / 3)
    assert obj["problems"][1] == {"id": "b", "n": 4, "correct": 2}


def test_compare_pairs_by_problem_id_and_leaves_out_the_rest(tmp_path):
    write(tmp_path / "a.json", ["x", "y", "z"], [2, 2, 2], [2, 2, 0])
    write(tmp_path / "b.json", ["z", "y", "w"], [3, 3, 3], [0, 1, 3])
    obj = compare_object(str(tmp_path / "a.json"), str(tmp_path / "b.json"), reps=100)
    assert obj["problems"] == 2 and obj["problems_left_out"] == 2  # x and w are on one side only
    assert list(obj["difference"]) == ["pass@1", "pass@2"]
    # on y and z: A solves y 2/2, z 0/2; B solves y 1/3, z 0/3
    assert obj["difference"]["pass@1"]["mean"] == pytest.approx((1 - 1 / 3) / 2)


def test_old_result_files_with_per_task_rates_still_read(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"samples": 4, "per_task": {"a": 0.25, "b": 1.0}}))
    write(tmp_path / "new.json", ["a", "b"], [4, 4], [1, 4])
    obj = compare_object(str(tmp_path / "old.json"), str(tmp_path / "new.json"), reps=50)
    assert obj["difference"]["pass@1"]["mean"] == 0 and obj["difference"]["pass@1"]["p_value"] == 1.0


def test_pooling_and_side_specs(tmp_path):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for seed in range(3):
        write(run / "eval" / f"seed{seed}.json", [f"p{i}" for i in range(20)], [4] * 20, rng.integers(0, 5, 20))
    assert len(result_files(str(run))) == 3  # a run directory without eval.json: its eval/*.json
    obj = pool_object(str(run), reps=100)
    assert obj["bootstrap"]["runs"] == 3 and obj["bootstrap"]["problems"] == 20
    write(run / "eval.json", ["p0"], [4], [1])
    assert result_files(str(run)) == [run / "eval.json"]  # eval.json, when there, is the run's result
    with pytest.raises(RlttError, match="no such result"):
        result_files(str(tmp_path / "missing.json"))
    with pytest.raises(RlttError, match="no result matches"):
        result_files(str(tmp_path / "*.nothing"))


def test_bad_counts_are_errors():
    with pytest.raises(RlttError, match="correct <= n"):
        ProblemCounts(["a"], [2], [3])
    with pytest.raises(RlttError, match="twice"):
        ProblemCounts(["a", "a"], [2, 2], [1, 1])
