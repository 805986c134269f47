"""`rltt eval --samples/--json/--out` and `rltt eval --compare/--pool` end to end on a tiny random
LoopLM: pass@1 … pass@k with intervals from per-problem counts, for each schedule and exit policy."""

import json
import math

import numpy as np
import pytest
import yaml

from rltt.cli.main import main
from tests.orchestration.helpers import tiny_checkpoint

PARITY_REWARD = '''
def parity(completion, answer, **kw):
    """1 when the completion's code points sum to an even number: a random policy solves some
    samples of a prompt, not all."""
    return float(sum(map(ord, completion)) % 2 == 0)
'''


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-recipe")
    ckpt = tiny_checkpoint(root / "policy")
    (root / "parity.py").write_text(PARITY_REWARD)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(ckpt)},
        "data": {"source": "synthetic:easy", "eval_size": 6},
        "rewards": [{"fn": "parity.py:parity"}],
        "rollout": {"group_size": 2, "max_new_tokens": 6, "temperature": 1.0},
        "train": {"eval_temperature": 1.0},
    }))
    return path


def eval_json(recipe, capsys, overrides, *extra):
    assert main(["eval", str(recipe), *overrides, "--limit", "6", "--json", "--bootstrap", "200", *extra]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object, nothing else on stdout
    return json.loads(out)


def brute_pass_at_k(n, c, k):
    return 1 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("policy", [[], ["rollout.schedule=dense"], ["rollout.exit_policy=final"],
                                    ["rollout.exit_policy=fixed:2"], ["rollout.exit_policy=sample"]])
def test_samples_json_reports_pass_at_k_with_intervals(recipe, capsys, policy):
    obj = eval_json(recipe, capsys, policy, "--samples", "4")
    assert obj["format"] == "rltt-eval/1" and obj["samples"] == 4 and obj["tasks"] == 6
    summary = obj["summary"]
    assert list(summary) == ["pass@1", "pass@2", "pass@3", "pass@4", "mean@4"]
    problems = obj["problems"]
    assert len(problems) == 6 and all(p["n"] == 4 and 0 <= p["correct"] <= 4 for p in problems)
    assert len({p["correct"] for p in problems}) > 1  # the parity reward mixes: pass@k varies with k
    for k in range(1, 5):
        s = summary[f"pass@{k}"]
        assert s["mean"] == pytest.approx(np.mean([brute_pass_at_k(4, p["correct"], k) for p in problems]))
        assert s["ci95"][0] <= s["mean"] <= s["ci95"][1] and s["se"] >= 0
    assert summary["pass@1"]["mean"] == pytest.approx(obj["solve_rate"]) == pytest.approx(summary["mean@4"]["mean"])
    assert summary["pass@1"]["mean"] <= summary["pass@4"]["mean"]
    assert obj["bootstrap"]["reps"] == 200 and obj["bootstrap"]["resampled"] == "problems"


def test_text_output_and_out_file(recipe, tmp_path, capsys):
    out = tmp_path / "run" / "eval.json"
    assert main(["eval", str(recipe), "--samples", "3", "--limit", "4", "--out", str(out), "--bootstrap", "100"]) == 0
    text = capsys.readouterr().out
    assert "solve rate" in text and "pass@3" in text and "mean@3" in text and f"written: {out}" in text
    obj = json.loads(out.read_text())
    assert obj["per_task"] and list(obj["summary"]) == ["pass@1", "pass@2", "pass@3", "mean@3"]


def test_compare_files_directories_and_seeds(recipe, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for seed in (0, 1, 2):  # three evaluation seeds of the policy on the same problems
        assert main(["eval", str(recipe), f"seed={seed}", "--samples", "2", "--limit", "6", "--bootstrap", "50",
                     "--out", str(a / f"eval-seed{seed}.json")]) == 0
    assert main(["eval", str(recipe), "--samples", "3", "--limit", "6", "--bootstrap", "50",
                 "--out", str(b / "eval.json")]) == 0
    capsys.readouterr()

    # the same file on both sides: no difference
    same = a / "eval-seed0.json"
    assert main(["eval", "--compare", str(same), str(same), "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["format"] == "rltt-eval-compare/1" and obj["problems"] == 6 and list(obj["difference"]) == [
        "pass@1", "pass@2"]
    d = obj["difference"]["pass@1"]
    assert d["mean"] == 0 and d["p_value"] == 1.0 and obj["test"] == "problems"
    assert d["ci95"] == pytest.approx([0.0, 0.0], abs=1e-9)  # no δ ≠ 0 passes the inverted test

    # a directory of three runs (pooled) against a run directory's eval.json
    assert main(["eval", "--compare", str(a), str(b), "--json", "--bootstrap", "300"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["a"]["runs"] == 3 and obj["b"]["runs"] == 1 and len(obj["a"]["files"]) == 3
    assert list(obj["difference"]) == ["pass@1", "pass@2"]  # the fewest samples of either side: 2
    d = obj["difference"]["pass@1"]
    assert d["mean"] == pytest.approx(obj["a"]["summary"]["pass@1"]["mean"] - obj["b"]["summary"]["pass@1"]["mean"])
    assert 0 < d["p_value"] <= 1 and d["ci95"][0] <= d["mean"] <= d["ci95"][1] and d["test"] == "problems"

    # a glob and a comma list name the same runs; two or more runs a side: the runs test
    spec = f"{a}/eval-seed0.json,{a}/eval-seed1.json"
    assert main(["eval", "--compare", str(a / "eval-seed*.json"), spec, "--bootstrap", "100"]) == 0
    text = capsys.readouterr().out
    assert "A: 3 run(s)" in text and "B: 2 run(s)" in text and "permutation of runs" in text and "pass@2" in text

    assert main(["eval", "--pool", str(a), "--json", "--bootstrap", "100"]) == 0
    pooled = json.loads(capsys.readouterr().out)
    assert pooled["bootstrap"]["runs"] == 3 and pooled["bootstrap"]["resampled"] == "runs, then problems"
    assert all(p["n"] == 6 for p in pooled["problems"])


def test_result_errors_are_one_line(recipe, tmp_path, capsys):
    assert main(["eval"]) == 2
    assert "give a RECIPE.yaml" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["eval", "--compare", str(empty), str(empty)]) == 2
    err = capsys.readouterr().err
    assert "no eval.json" in err and "\n" not in err.strip()
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x"}')
    assert main(["eval", "--compare", str(bad), str(bad)]) == 2
    assert "not an rltt eval result" in capsys.readouterr().err
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps({"problems": [{"id": "p1", "n": 2, "correct": 1}]}))
    two.write_text(json.dumps({"problems": [{"id": "p2", "n": 2, "correct": 1}]}))
    assert main(["eval", "--compare", str(one), str(two)]) == 2
    assert "share no problem ids" in capsys.readouterr().err
    assert main(["eval", str(recipe), "--compare", str(one), str(one)]) == 2
    assert "take no recipe" in capsys.readouterr().err


def test_rltt_math_recipe_evaluates_a_math500_file(tmp_path, capsys):
    """recipes/rltt-math.yaml on CPU with a tiny chat checkpoint and a MATH-500-layout file the
    test writes: chat prompts, the thinking budget, math_verify on \\boxed{} answers, pass@k."""
    pytest.importorskip("math_verify")
    from pathlib import Path

    from tests.data.chat_tokenizer import chat_checkpoint
    from tests.data.test_math_sets import MATH500, write_jsonl

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "rltt-math.yaml"
    source = write_jsonl(tmp_path / "math500.jsonl", MATH500)
    ckpt = chat_checkpoint(tmp_path / "policy")
    capsys.readouterr()  # what saving the checkpoint printed
    overrides = [f"model.path={ckpt}", "model.dtype=fp32", "model.device=cpu", f"data.source={source}",
                 "rollout.max_new_tokens=4", "rollout.thinking.budget=4", "rollout.thinking.answer_budget=2",
                 "rollout.thinking.interruption=\n</think>\n", "learner.backend=torch", "learner.dtype=fp32"]
    assert main(["eval", str(recipe), *overrides, "--source", str(source), "--samples", "2", "--json",
                 "--bootstrap", "100"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert [p["id"] for p in obj["problems"]] == ["test/prealgebra/1.json", "test/algebra/2.json"]
    assert list(obj["summary"]) == ["pass@1", "pass@2", "mean@2"] and obj["exit_policy"] is None


def test_rltt_math_recipe_has_the_published_settings():
    from pathlib import Path

    from rltt.orchestration.train_recipe import load_train_recipe

    recipe = load_train_recipe(Path(__file__).resolve().parents[2] / "recipes" / "rltt-math.yaml",
                               ["model.path=quickstart"])
    ro, alg = recipe.rollout, recipe.algorithm
    assert (ro.prompts_per_step, ro.group_size, ro.max_new_tokens) == (32, 8, 2048)
    assert recipe.learner.lr == 1e-6 and alg.kl_coef == 0.001
    assert alg.policy_logprob == "rltt" and alg.omega == "exit_pdf"
    assert recipe.rewards[0].fn == "rewards/math.py:math_verify"
    assert recipe.data.eval_source == "HuggingFaceH4/MATH-500" and recipe.data.prompt_format == "chat"
