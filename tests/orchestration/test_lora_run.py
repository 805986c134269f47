"""`rltt train` with ``learner.lora`` end to end on a tiny model: only the adapters move, chunked
rollouts, an engine copy refreshed with adapter tensors alone, the resumed run equals the
uninterrupted one, checkpoints hold the PEFT adapter, `rltt merge` writes the merged model."""

import json

import pytest
import torch

from rltt.cli.main import main
from rltt.model import load_looped
from rltt.model.adapters import is_adapter
from rltt.orchestration.train_recipe import load_train_recipe
from rltt.orchestration.trainer import Trainer
from rltt.telemetry import read_metrics

from .test_local import write_recipe

LORA = {"learner.lora": {"rank": 4, "alpha": 8.0}, "learner.lr": 1e-2}
EXACT = ("reward/mean", "loss/total", "kl/ref", "grad_norm/total", "length/mean", "lora/update_norm/q_proj")


def _run(tmp_path, overrides=(), **recipe):
    path = write_recipe(tmp_path, **{**LORA, **recipe})
    trainer = Trainer(load_train_recipe(path, list(overrides)), recipe_root=tmp_path)
    base = {k: v.clone() for k, v in trainer.learner_model().state_dict().items() if not is_adapter(k)}
    trainer.run()
    return trainer, base, [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]


@pytest.mark.parametrize("overrides", [["rollout.chunk_rows=3"], ["learner.dtype=bf16"]])
def test_a_lora_run_trains_the_adapters_alone(tmp_path, overrides):
    trainer, base, records = _run(tmp_path, overrides)
    state = trainer.learner_model().state_dict()
    for key, value in base.items():
        assert torch.equal(state[key], value), key
    assert records[-1]["lora/update_norm/q_proj"] > 0 and "kl/ref" in records[-1]
    engine_model = trainer.engine.model  # bf16: a copy of its own, refreshed with the adapters alone
    for key, value in state.items():
        assert torch.equal(engine_model.state_dict()[key], value.to(engine_model.dtype)), key
    adapter = tmp_path / "run" / "checkpoints" / "step-0000003" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and (adapter / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_resume_equals_the_uninterrupted_lora_run(tmp_path):
    _, _, reference = _run(tmp_path / "a")
    part = write_recipe(tmp_path / "b", **LORA)
    Trainer(load_train_recipe(part, ["train.steps=2"]), recipe_root=tmp_path / "b").run()
    Trainer(load_train_recipe(part), resume=True, recipe_root=tmp_path / "b").run()
    resumed = [r for r in read_metrics(tmp_path / "b" / "run") if r["step"] > 0]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in EXACT:
        assert resumed[2][key] == reference[2][key], key
    a = load_looped(tmp_path / "a" / "run" / "checkpoints" / "step-0000003").state_dict()
    b = load_looped(tmp_path / "b" / "run" / "checkpoints" / "step-0000003").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rltt_merge_writes_the_merged_model(tmp_path, capsys):
    trainer, _, _ = _run(tmp_path)
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000003"
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "base.json").is_file()  # adapters, not the base
    assert main(["merge", str(ckpt), str(tmp_path / "merged")]) == 0
    merged = load_looped(tmp_path / "merged").eval()
    assert not merged.config.lora_rank and not any(is_adapter(k) for k in merged.state_dict())
    ids = torch.tensor([[1, 5, 9, 4]])
    with torch.no_grad():
        want = trainer.learner_model().eval()(ids, use_cache=False).logits
        torch.testing.assert_close(merged(ids, use_cache=False).logits, want, rtol=1e-4, atol=1e-4)
    assert main(["merge", str(ckpt), str(tmp_path / "merged")]) == 2  # never over an existing directory
    assert main(["merge", str(tmp_path / "merged"), str(tmp_path / "again")]) == 2  # no adapters there
    assert "no LoRA adapters" in capsys.readouterr().err
    assert main(["generate", "--model", str(ckpt), "--prompt", "1 2", "--max-new-tokens", "2"]) == 0  # base + adapters
    assert "completion:" in capsys.readouterr().out


@pytest.mark.parametrize("serving", ["adapters", "merged"])
def test_per_loop_adapters_with_vllm_are_a_recipe_error(tmp_path, serving):
    path = write_recipe(tmp_path, **LORA)
    with pytest.raises(Exception, match="learner.lora.per_loop"):
        load_train_recipe(path, ["learner.lora.per_loop=true", "rollout.engine=vllm", "rollout.schedule=dense",
                                 f"rollout.vllm.lora={serving}"])


def test_vllm_serves_ranks_it_has_slots_for(tmp_path):
    path = write_recipe(tmp_path, **{**LORA, "learner.lora": {"rank": 1024, "alpha": 8.0}})
    with pytest.raises(Exception, match="learner.lora.rank.*rank <= 512"):
        load_train_recipe(path, ["rollout.engine=vllm", "rollout.schedule=dense"])
    load_train_recipe(path, ["rollout.engine=vllm", "rollout.schedule=dense", "rollout.vllm.lora=merged"])
    with pytest.raises(Exception, match="rollout.vllm.lora"):
        load_train_recipe(path, ["rollout.engine=vllm", "rollout.schedule=dense", "rollout.vllm.lora=peft"])


def test_the_engine_decides_the_sync(tmp_path):
    """The native engine applies adapters (its model gets them before the learner is built; the
    learner sends adapter tensors); vLLM serves them as its own LoRA and is sent the adapters
    (rollout.vllm.lora: adapters) or is sent the merged weights (merged); its model never holds
    adapters."""
    from rltt.orchestration.components import make_learner
    from rltt.orchestration.engines import ENGINES
    from tests.learner.helpers import tiny_policy

    assert ENGINES["native"].adapters(None) == "model"
    assert ENGINES["vllm"].adapters({"vllm": {"lora": "merged"}}) == "merged"
    assert ENGINES["vllm"].adapters({"vllm": {}}) == ENGINES["vllm"].adapters(None) == "served"
    for engine, serving, sync in (("native", "adapters", "adapters"), ("vllm", "adapters", "adapters"),
                                  ("vllm", "merged", "merged")):
        recipe = load_train_recipe(write_recipe(tmp_path / f"{engine}-{serving}", **LORA),
                                   [f"rollout.engine={engine}", "rollout.schedule=dense",
                                    f"rollout.vllm.lora={serving}"])
        learner = make_learner(recipe, tiny_policy())
        assert learner.sync == sync
        _, tensors = learner.rollout_state_dict()
        assert all(is_adapter(k) for k in tensors) == (sync == "adapters")
