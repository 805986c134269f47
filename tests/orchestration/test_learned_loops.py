"""ω = learned through `rltt train`: the learner owns the loop weights, trains them, saves them
with the checkpoint and hands them to the engine with every weight sync (fp32 and bf16)."""

import pytest
import torch
from safetensors.torch import load_file

from rltt.cli.main import main
from rltt.learner import LEARNER_STATE
from rltt.orchestration.trainer import Trainer
from rltt.orchestration.train_recipe import load_train_recipe

from .test_local import write_recipe

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_learned_loop_weights_reach_the_checkpoint_and_the_engine(tmp_path, dtype, capsys):
    path = write_recipe(tmp_path)
    overrides = ["algorithm.policy_logprob=rltt", "algorithm.omega=learned", f"learner.dtype={dtype}",
                 "train.eval_every=0", "checkpoint.every=0", "learner.lr=1e-2"]
    assert main(["train", str(path), *overrides]) == 0, capsys.readouterr().err
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000003"
    state = torch.load(ckpt / LEARNER_STATE, weights_only=False)
    logits = state["loop_weight_logits"]
    assert state["version"] == 3 and logits.shape == (3,) and bool(torch.isfinite(logits).all())
    assert float(logits.abs().max()) > 0  # trained away from the uniform start (zeros)
    assert "loop_weight_logits" not in load_file(str(ckpt / "model.safetensors"))  # the model files stay the model's

    # a resumed run: the learner and its engine serve exactly the checkpoint's loop weights
    trainer = Trainer(load_train_recipe(path, [*overrides, "train.steps=4"]), resume=True, recipe_root=tmp_path)
    assert trainer.step == 3 and trainer.learner.version == 3 and trainer.engine.weights_version == 3
    assert torch.equal(trainer.learner.learned_logits.detach().float(), logits)
    served = trainer.engine.extra_weights["loop_weight_logits"]
    assert served.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
    assert torch.equal(served.float(), logits)
    # the next step's weight sync hands over the updated values
    trainer.train_step(4)
    assert trainer.engine.weights_version == 4
    updated = trainer.learner.learned_logits.detach()
    assert not torch.equal(updated.float(), logits)
    assert torch.equal(trainer.engine.extra_weights["loop_weight_logits"], updated.to(served.dtype))
