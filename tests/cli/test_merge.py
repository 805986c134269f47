"""`rltt merge --format ouro`: the Ouro checkpoint it writes names Ouro's code on the hub
(``auto_map``), and a model Ouro's format cannot hold is refused naming the field that stops it."""

import copy
import json

import torch

from rltt.cli.main import main
from rltt.model import load_ouro
from rltt.model.adapters import AdapterSpec, adapted, attach_adapters
from rltt.model.ouro import OURO_AUTO_MAP
from tests.model.helpers import tiny_model


def lora_checkpoint(path, **model_kw):
    """A LoRA run's checkpoint folder as the learner saves it (the model with its shared adapters)."""
    model = copy.deepcopy(tiny_model(**model_kw))
    attach_adapters(model, AdapterSpec(4, 8.0, ("q_proj", "v_proj")))
    with torch.no_grad():
        for _, layer in adapted(model):
            layer.lora_B.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return model


def test_merge_to_ouro_writes_the_auto_map(tmp_path):
    model = lora_checkpoint(tmp_path / "ckpt", norm_placement="ouro", injection="none")
    assert main(["merge", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--format", "ouro"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "ouro" and config["auto_map"] == OURO_AUTO_MAP
    assert OURO_AUTO_MAP["AutoModelForCausalLM"] == "ByteDance/Ouro-1.4B--modeling_ouro.OuroForCausalLM"
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        want = model.eval()(ids, use_cache=False).logits
        got = load_ouro(tmp_path / "out")(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_merge_to_ouro_refuses_a_pre_norm_model_naming_the_norm_placement(tmp_path, capsys):
    lora_checkpoint(tmp_path / "ckpt", norm_placement="pre", injection="scalar")
    assert main(["merge", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--format", "ouro"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the loading's progress bars
    assert err.startswith("rltt merge: error: --format ouro: Ouro's format cannot express norm_placement='pre' (")
    assert err.endswith(")") and "merge" not in err.split(": ", 2)[2] and "sandwich" in err
    assert not (tmp_path / "out").exists()
