"""Smoke test of bench/trl_compare.py at toy size (tiny random LoopLM, 2 steps of 2 prompts x G=2)."""

import math

import pytest

from tests.bench.helpers import load_bench


def _load():
    return load_bench("trl_compare")


def test_write_section_touches_only_its_section(tmp_path):
    bench = _load()
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## Other (bench/other.py)\n\nkeep me\n")
    bench.write_section("first", path)
    bench.write_section("second", path)
    text = path.read_text()
    assert "keep me" in text and "second" in text and "first" not in text
    assert text.count(bench.SECTION) == 1


@pytest.mark.slow
def test_toy_run(tmp_path):
    pytest.importorskip("trl")
    bench = _load()
    args = bench.parse_args(["--model", "tiny", "--steps", "2", "--warmup-steps", "1", "--prompts", "2",
                             "--group", "2", "--micro", "2", "--max-new-tokens", "6", "--eval-size", "4",
                             "--eval-samples", "1", "--out", str(tmp_path)])
    res = bench.run(args)
    assert len(res["rltt_steps"]) == 2 and len(res["trl_steps"]) == 2
    assert math.isfinite(res["ratio_wall"]) and res["ratio_wall"] > 0
    for key in ("solve_before", "solve_after_rltt", "solve_after_trl"):
        assert 0.0 <= res[key] <= 1.0
    assert (tmp_path / "rltt" / "metrics.jsonl").is_file()
    assert "ratio rltt/TRL" in bench.format_table(res)


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_reach_both_trainers(tmp_path, threads):
    """``--threads`` is rltt's ``train.threads`` too: rltt's trainer sets the process's torch threads,
    which TRL then runs with (a recipe value would otherwise win silently)."""
    from rltt.orchestration.train_recipe import load_train_recipe

    bench = _load()
    args = bench.parse_args(["--threads", str(threads)])
    recipe = load_train_recipe(bench.RECIPE, bench.rltt_overrides(args, tmp_path / "model", tmp_path / "run"))
    assert recipe.train.threads == threads
