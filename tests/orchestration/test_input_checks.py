"""Bad data reaches `rltt train` as one-line errors before any step, leaving nothing that blocks the
corrected rerun: a non-UTF-8 data file, a prompt too long for the model's positions."""

import json
import subprocess
import sys

import yaml

from .helpers import tiny_checkpoint


def _run(tmp_path, data_file, data=None, **rollout):
    recipe = {
        "model": {"path": str(tiny_checkpoint(tmp_path / "policy"))},
        "data": {"source": str(data_file), "eval_source": "synthetic:easy", "eval_size": 4, **(data or {})},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}],
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6, **rollout},
        "learner": {"micro_batch_size": 4},
        "train": {"steps": 1, "eval_every": 0},
        "logging": {"run_dir": str(tmp_path / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 0, "save_final": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return subprocess.run([sys.executable, "-m", "rltt.cli.main", "train", str(path)], capture_output=True,
                          text=True, timeout=600)


def _records(n, question="What is 2 + 3?"):
    return "".join(json.dumps({"question": question, "answer": "2 + 3 = 5\n#### 5"}) + "\n" for _ in range(n))


def _one_line_error(result):
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("rltt train: error")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return lines[0]


def test_non_utf8_data_file_is_one_line_naming_file_and_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_bytes(_records(3).encode() + b'{"question": "caf\xe9 ?", "answer": "#### 1"}\n')
    line = _one_line_error(_run(tmp_path, data))
    assert f"{data}:4" in line and "not UTF-8" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_prompt_too_long_for_the_model_names_the_record_and_the_limit(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(_records(2) + _records(1, question="1 + " * 700 + "1 = ?"))  # position limit: 2048
    line = _one_line_error(_run(tmp_path, data))
    assert "train-3" in line and "max_position_embeddings" in line and "rollout.max_new_tokens=6" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    data.write_text(_records(3))  # the corrected rerun starts in the same run_dir
    result = _run(tmp_path, data)
    assert result.returncode == 0, result.stderr[-2000:]


def test_prompt_longer_than_max_prompt_tokens_names_the_key_and_the_record(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(_records(2) + _records(1, question="1 + " * 100 + "1 = ?"))  # ~450 char tokens
    recipe_line = _one_line_error(_run(tmp_path, data, {"max_prompt_tokens": 200}))
    assert "data.max_prompt_tokens" in recipe_line and "'train-3' (index 2)" in recipe_line
    assert "data.drop_long_prompts" in recipe_line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    result = _run(tmp_path, data, {"max_prompt_tokens": 200, "drop_long_prompts": True})  # dropped, counted
    assert result.returncode == 0, result.stderr[-2000:]
    assert "dropped 1 training and 0 held-out prompts longer than data.max_prompt_tokens=200" in result.stderr


def test_a_run_that_cannot_fit_is_refused_before_loading_with_one_line_naming_keys(tmp_path, monkeypatch, capsys):
    """A folder holding only an Ouro-1.4B-shaped config.json: the plan refuses the run (fp32 AdamW
    on an 8 GiB machine) before any weight would be read — there are none — and writes nothing."""
    from rltt.cli.main import main
    from rltt.planning import sources

    from ..planning.helpers import OURO_1_4B, config_folder

    model = config_folder(tmp_path, OURO_1_4B, "ouro")
    monkeypatch.setattr(sources, "available_cpu_bytes", lambda: 8 * 2**30)
    recipe = yaml.safe_load(open("recipes/quickstart.yaml"))
    recipe["model"] = {"path": str(model), "device": "cpu"}
    recipe["logging"] = {"run_dir": str(tmp_path / "run"), "progress": False}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("rltt train: error: does not fit in 8.0 GiB"), err
    assert "learner." in err[0] or "rollout." in err[0]  # names the recipe key(s) to change
    assert not (tmp_path / "run").exists()

