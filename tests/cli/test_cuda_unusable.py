"""The GPU recipes say ``model.device: cuda``; where CUDA is unusable, ``rltt train``, ``eval`` and
``curate`` on them stop in one line naming the key and why, before any model, data or run folder is
touched; ``rltt plan`` still plans them for a GPU of ``--gpu-memory`` GiB."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from rltt.cli.main import main
from rltt.runtime import device as dev

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
GPU_RECIPES = ("gsm8k.yaml", "gsm8k-thinking.yaml", "rltt-math.yaml")


@pytest.fixture
def nothing_loads(monkeypatch):
    """Any model, tokenizer, data or config read fails the test: the command must stop before."""
    import rltt.orchestration.policy as policy
    import rltt.orchestration.trainer as trainer
    import rltt.planning.sources as sources

    def forbidden(*_a, **_k):
        raise AssertionError("loaded something before the device check")
    monkeypatch.setattr(policy, "load_policy", forbidden)
    monkeypatch.setattr(trainer, "plan_here", forbidden)
    monkeypatch.setattr(sources, "model_config", forbidden)


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipes_ask_for_cuda(name):
    assert yaml.safe_load((RECIPES / name).read_text())["model"]["device"] == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable CUDA")
def test_train_on_this_machine_stops_in_one_line(tmp_path, capsys, nothing_loads):
    run_dir = tmp_path / "run"
    assert main(["train", str(RECIPES / "gsm8k.yaml"), f"logging.run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'model.device'" in err and "CUDA is unusable here" in err, err
    assert not run_dir.exists()


@pytest.mark.parametrize("command", ["train", "eval", "curate"])
@pytest.mark.parametrize("name", GPU_RECIPES)
def test_old_driver_stops_every_command_before_work(monkeypatch, tmp_path, capsys, nothing_loads, command, name):
    """The cu130 wheel on a CUDA 12.2 driver: the versions, in one line."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dev, "driver_cuda_version", lambda: (12, 2))
    monkeypatch.setattr(dev, "driver_release", lambda path=None: "535.104.05")
    run_dir = tmp_path / "run"
    args = [command, str(RECIPES / name), f"logging.run_dir={run_dir}"]
    if command == "curate":
        args += ["--out", str(tmp_path / "out.jsonl")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"rltt {command}: error: recipe key 'model.device': is 'cuda' but CUDA is unusable here: "
                          "the NVIDIA driver 535.104.05 supports CUDA up to 12.2 but torch "), err
    assert "built for CUDA 13.0: update the driver to >= 580.65.06" in err
    assert not run_dir.exists() and not list(tmp_path.iterdir())


def test_plan_still_plans_a_gpu_recipe_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", str(RECIPES / "gsm8k.yaml"), "model.path=quickstart", "--gpu-memory", "80", "--json"]) == 0
    assert '"device": "cuda"' in capsys.readouterr().out
    assert main(["plan", str(RECIPES / "gsm8k.yaml"), "model.path=quickstart"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.device='cuda'" in err and "--gpu-memory" in err
    assert main(["plan", str(RECIPES / "gsm8k.yaml"), "model.path=quickstart", "--cpu"]) == 0
