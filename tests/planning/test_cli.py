"""``rltt plan``: exit codes (0 fits, 2 with one line naming recipe keys), the table and ``--json``."""

import json
from pathlib import Path

import pytest

from rltt.cli.main import main
from tests.planning.helpers import OURO_1_4B, TINY_LOOPED, config_folder

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
GSM8K = str(RECIPES / "gsm8k.yaml")
QUICKSTART = str(RECIPES / "quickstart.yaml")


@pytest.fixture
def ouro(tmp_path):
    return config_folder(tmp_path, OURO_1_4B, "Ouro-1.4B")


def test_too_big_exits_2_with_one_line_naming_keys(ouro, capsys):
    code = main(["plan", GSM8K, f"model.path={ouro}", "learner.micro_batch_size=8", "--gpu-memory", "80"])
    out, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert "learner.activation_checkpointing=true" in lines[0] and "learner.micro_batch_size=" in lines[0]
    assert "activations (one micro-batch)" in out and "rollout KV" in out and "learner phase peak" in out
    assert "1,434,652,673 parameters" in out and "786,432 bytes" in out


def test_json_has_the_documented_keys(ouro, capsys):
    code = main(["plan", GSM8K, f"model.path={ouro}", "--gpu-memory", "141", "--json"])
    out, err = capsys.readouterr()
    plan = json.loads(out)
    assert code == (0 if plan["fits"] else 2)
    for key in ("fits", "device_bytes", "parameters", "kv_bytes_per_token", "rollout_rows_per_chunk", "peak_bytes",
                "components"):
        assert key in plan
    assert set(plan["components"]) >= {"weights", "reference", "gradients", "optimizer", "activations", "rollout_kv"}
    assert plan["device_bytes"] == 141 * 2**30 and plan["parameters"] == 1_434_652_673
    assert plan["kv_bytes_per_token"] == 786_432 and plan["rollout_rows_per_chunk"] % 8 == 0
    assert plan["peak_bytes"] == max(plan["phases"].values())


def test_fits_exits_0(tmp_path, capsys):
    folder = config_folder(tmp_path, TINY_LOOPED)
    code = main(["plan", QUICKSTART, f"model.path={folder}", "--gpu-memory", "8"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert "verdict: fits" in out and "rollout chunk: 64 rows" in out


def test_cpu_plan_uses_the_available_memory(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("rltt.planning.sources.available_cpu_bytes", lambda: 6 * 2**30)
    folder = config_folder(tmp_path, TINY_LOOPED)
    code = main(["plan", QUICKSTART, f"model.path={folder}", "--cpu", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["device"] == "cpu" and plan["device_bytes"] == 6 * 2**30


def test_cuda_recipe_without_a_gpu_needs_gpu_memory(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    folder = config_folder(tmp_path, TINY_LOOPED)
    code = main(["plan", QUICKSTART, f"model.path={folder}", "model.device=cuda"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--gpu-memory" in err
    code = main(["plan", QUICKSTART, f"model.path={folder}", "model.device=cuda", "--gpu-memory", "16", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["device"] == "cuda"


def test_quickstart_path_resolves_without_building(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RLTT_CACHE", str(tmp_path / "empty-cache"))
    code = main(["plan", QUICKSTART, "--gpu-memory", "8"])
    out = capsys.readouterr().out
    assert code == 0 and "pretrain-tiny.yaml's model.config (not built yet)" in out
    assert not (tmp_path / "empty-cache").exists()


def test_bad_arguments_are_one_line(ouro, capsys):
    assert main(["plan", GSM8K, f"model.path={ouro}", "--gpu-memory", "-1"]) == 2
    assert main(["plan", GSM8K, f"model.path={ouro}", "--gpus", "0", "--gpu-memory", "80"]) == 2
    assert main(["plan", GSM8K, f"model.path={ouro}", "--cpu", "--gpu-memory", "80"]) == 2
    assert main(["plan", GSM8K, "model.path=/nonexistent/dir", "--gpu-memory", "80"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("rltt plan: error:") for line in err)


def test_vllm_dense_on_80_gib_fits_and_says_allocated_vs_reserved(ouro, capsys):
    """`rltt plan recipes/gsm8k.yaml rollout.engine=vllm rollout.schedule=dense --gpu-memory 80`:
    vLLM asleep in the update; the table says its figures are allocated bytes and what the
    allocator may reserve beyond them is the headroom's."""
    code = main(["plan", GSM8K, f"model.path={ouro}", "rollout.engine=vllm", "rollout.schedule=dense",
                 "--gpu-memory", "80"])
    out, err = capsys.readouterr()
    assert code == 0 and err == "", err
    assert "component (allocated bytes)" in out and "torch.cuda.memory_reserved" in out
    assert "train.memory_headroom=0.1 of 80.00 GiB" in out and "of 72.00 GiB usable" in out
    assert "vLLM held in the update" in out and "vLLM woken (weights + KV)" in out
    code = main(["plan", GSM8K, f"model.path={ouro}", "--gpu-memory", "80", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["headroom"] == 0.1 and plan["budget_bytes"] == int(0.9 * 80 * 2**30)
