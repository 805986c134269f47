"""`rltt curate` and `rltt eval` end to end on a tiny random LoopLM checkpoint."""

import json

import pytest
import yaml

from rltt.cli.main import main
from rltt.data.gsm8k import load_gsm8k

from tests.orchestration.helpers import tiny_checkpoint


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    ckpt = tiny_checkpoint(root / "policy")
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(ckpt)},
        "data": {"source": "synthetic:easy", "eval_size": 3},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}],
        "rollout": {"group_size": 2, "max_new_tokens": 4},
    }))
    return path


def curate(recipe, out, *extra):
    return main(["curate", str(recipe), "--out", str(out), "--no-progress", *extra])


def test_curate_resumes_to_the_uninterrupted_result(recipe, tmp_path, capsys):
    full = tmp_path / "full.jsonl"
    assert curate(recipe, full, "--limit", "3", "--samples", "3") == 0
    printed = capsys.readouterr().out
    assert "3 prompts (3 sampled now, 0 resumed), 3 samples each" in printed
    assert "solve rate  band  prompts" in printed

    part = tmp_path / "part.jsonl"
    assert curate(recipe, part, "--limit", "1", "--samples", "3") == 0  # stopped after one prompt
    assert curate(recipe, part, "--limit", "3", "--samples", "3") == 0
    assert "3 prompts (2 sampled now, 1 resumed)" in capsys.readouterr().out
    assert part.read_bytes() == full.read_bytes()  # per-prompt seeds: the real sampler reproduces

    records = [json.loads(line) for line in full.read_text().splitlines()]
    assert all(len(r["rewards"]) == 3 and 1 <= r["mean_exit_step"] <= 3 for r in records)
    assert [r["id"] for r in load_gsm8k(full)] == [r["id"] for r in records]
    assert (tmp_path / "full.kept.jsonl").exists() and (tmp_path / "full.hist.png").exists()


def test_curate_user_errors_are_one_line(recipe, tmp_path, capsys):
    assert curate(recipe, tmp_path / "c.jsonl") == 2  # a synthetic source needs --limit
    assert capsys.readouterr().err.strip() == (
        "rltt curate: error: --limit: the synthetic source 'synthetic:easy' is endless; pass --limit N")

    out = tmp_path / "bad.jsonl"
    out.write_text('{"id": "synthetic-0-0"}\n')
    assert curate(recipe, out, "--limit", "2") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rltt curate: error: {out}:1: not a curation record (missing") and "\n" not in err
    assert out.read_text() == '{"id": "synthetic-0-0"}\n'

    assert curate(recipe, tmp_path / "c.jsonl", "--limit", "2", "--band", "0.5") == 2
    assert "--band" in capsys.readouterr().err


def test_eval_writes_solve_rate_and_reward(recipe, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", str(recipe), "--samples", "2", "--limit", "2", "--out", str(out)]) == 0
    assert "solve rate" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["tasks"] == 2 and report["samples"] == 2 and report["split"] == "test"
    assert 0.0 <= report["solve_rate"] <= 1.0 and 0.0 <= report["reward_mean"] <= 1.0
    assert 1.0 <= report["mean_exit_step"] <= 3.0 and len(report["per_task"]) == 2

    assert main(["eval", str(recipe), "--samples", "0"]) == 2
    assert "--samples: must be >= 1" in capsys.readouterr().err


def _gsm8k_file(path, n=3):
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is {i} + 1?", "answer": f"#### {i + 1}"})
                            + "\n" for i in range(n)))
    return path


def test_curate_never_overwrites_its_inputs(recipe, tmp_path, capsys):
    source = _gsm8k_file(tmp_path / "train.jsonl")
    before = source.read_bytes()
    # --kept set to the data source: refused before any work, the training file untouched
    assert curate(recipe, tmp_path / "c.jsonl", "--source", str(source), "--kept", str(source)) == 2
    err = capsys.readouterr().err.strip()
    assert "--kept" in err and "the data source" in err and "\n" not in err
    assert source.read_bytes() == before
    # --out set to the data source
    assert curate(recipe, source, "--source", str(source)) == 2
    assert "--out" in capsys.readouterr().err and source.read_bytes() == before
    # --kept set to an existing file that is not a kept set of rltt curate
    other = tmp_path / "notes.jsonl"
    other.write_text('{"id": "x", "text": "mine"}\n')
    assert curate(recipe, tmp_path / "d.jsonl", "--source", str(source), "--kept", str(other)) == 2
    assert "was not written by this command" in capsys.readouterr().err
    assert other.read_text() == '{"id": "x", "text": "mine"}\n'
    # --kept set to the recipe file's path (a .jsonl recipe is still the recipe)
    jsonl_recipe = tmp_path / "recipe.jsonl"
    jsonl_recipe.write_text(recipe.read_text())
    from rltt.curation.curation_loop import CurationPaths
    from rltt.errors import RlttError

    with pytest.raises(RlttError, match="the recipe file"):
        CurationPaths.for_output(tmp_path / "e.jsonl", jsonl_recipe, {"the recipe file": jsonl_recipe})


def test_curate_rewrites_its_own_kept_set(recipe, tmp_path):
    source = _gsm8k_file(tmp_path / "train.jsonl")
    kept = tmp_path / "kept.jsonl"
    assert curate(recipe, tmp_path / "c.jsonl", "--source", str(source), "--kept", str(kept), "--samples", "2") == 0
    assert curate(recipe, tmp_path / "c2.jsonl", "--source", str(source), "--kept", str(kept), "--samples", "2") == 0


SLEEPY = """
import time

def sleepy(completion, answer, **kw):
    time.sleep(1000)
    return 1.0
"""


@pytest.fixture(scope="module")
def hanging_recipe(recipe):
    (recipe.parent / "slow_rewards.py").write_text(SLEEPY)
    spec = yaml.safe_load(recipe.read_text())
    spec["rewards"].append({"fn": "slow_rewards.py:sleepy", "timeout_s": 1.0})
    path = recipe.parent / "hanging.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_hanging_reward_times_out_in_curate_and_eval(hanging_recipe, tmp_path, capsys):
    import time

    from rltt.curation.recipes import RecipePolicy
    from rltt.orchestration.train_recipe import load_train_recipe

    with RecipePolicy.load(load_train_recipe(hanging_recipe), hanging_recipe.parent) as policy:
        assert [r.timeout_s for r in policy.runner.rewards] == [5.0, 1.0]  # the recipe's, per reward
    start = time.monotonic()
    out = tmp_path / "c.jsonl"
    assert curate(hanging_recipe, out, "--limit", "2", "--samples", "2") == 0  # rewards.1.timeout_s = 1 s
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    report = tmp_path / "eval.json"
    assert main(["eval", str(hanging_recipe), "--samples", "1", "--limit", "2", "--out", str(report)]) == 0
    assert time.monotonic() - start < 300  # the default 5 s, let alone 1000 s, never ran out per call
    assert json.loads(report.read_text())["tasks"] == 2
    capsys.readouterr()


def test_rollout_engine_reaches_the_engine_factory(recipe, tmp_path, monkeypatch, capsys):
    """``rollout.engine=vllm`` builds the vLLM engine (stood in for by a recording native engine: the
    factory's vLLM branch, its options and the close of the engine's process are what is checked)."""
    from rltt.rollout import NativeEngine
    from rltt.vllm import vllm_engine

    built = []

    class RecordingEngine(NativeEngine):
        def __init__(self, model, **options):
            super().__init__(model)
            self.options, self.closed = options, False
            built.append(self)

        def close(self):
            self.closed = True

    monkeypatch.setattr(vllm_engine, "require_vllm", lambda: None)
    monkeypatch.setattr(vllm_engine, "VllmEngine", RecordingEngine)
    out = tmp_path / "eval.json"
    assert main(["eval", str(recipe), "rollout.engine=vllm", "rollout.schedule=dense", "rollout.vllm.max_num_seqs=7",
                 "--samples", "1",
                 "--limit", "1", "--out", str(out)]) == 0
    assert len(built) == 1 and built[0].options["max_num_seqs"] == 7 and built[0].closed
    curated = tmp_path / "c.jsonl"
    assert main(["curate", str(recipe), "rollout.engine=vllm", "rollout.schedule=dense", "--out", str(curated),
                 "--no-progress", "--limit", "1", "--samples", "2"]) == 0
    assert len(built) == 2 and built[1].closed
    # the native engine's records do not resume under another engine
    assert main(["curate", str(recipe), "rollout.schedule=dense", "--out", str(curated), "--no-progress",
                 "--limit", "1", "--samples", "2"]) == 2
    assert "engine" in capsys.readouterr().err

    # the factory checks what vLLM cannot do, naming the recipe key
    assert main(["eval", str(recipe), "rollout.engine=vllm", "rollout.schedule=deferred", "--limit", "1"]) == 2
    assert "rollout.schedule" in capsys.readouterr().err
