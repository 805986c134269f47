"""LoRA adapters on the looped model (rltt.model.adapters): off = the base bit for bit, merged =
base + scale·BA, per-loop adapters act on their loop only, the adapter gradient is the projection
of the full weight gradient, PEFT's format (PEFT and AutoPeftModel load it; the PEFT-wrapped model
decodes the adapted function), the merged export in rltt's and Ouro's formats."""

import copy
import json

import pytest
import torch

from rltt.errors import RlttError
from rltt.model import load_looped, load_ouro
from rltt.model.adapters import (AdapterSpec, adapted, adapter_norms, adapters_disabled, attach_adapters, freeze_base,
                                 merge_adapters_, merged_state_dict, write_peft_adapter)
from rltt.model.ouro import OURO_AUTO_MAP, save_ouro

from .helpers import tiny_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _with_adapters(per_loop=False, targets=ALL, seed=0, **model_kw):
    torch.manual_seed(0)
    base = tiny_model(**model_kw)
    model = copy.deepcopy(base)
    attach_adapters(model, AdapterSpec(4, 8.0, targets, per_loop), seed=seed)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in adapted(model):  # a trained-looking adapter: B ≠ 0
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.05)
    return base, model


def _step_logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False, output_step_logits=True).step_logits


IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 8]])


def test_fresh_adapters_keep_the_function_and_draw_the_same_a_for_the_same_seed():
    base = tiny_model()
    one, two = copy.deepcopy(base), copy.deepcopy(base)
    assert attach_adapters(one, AdapterSpec(4, 8.0, ALL), seed=7)
    attach_adapters(two, AdapterSpec(4, 8.0, ALL), seed=7)
    assert not attach_adapters(two, AdapterSpec(4, 8.0, ALL), seed=9)  # already there: kept
    for (_, a), (_, b) in zip(adapted(one), adapted(two)):
        assert torch.equal(a.lora_A, b.lora_A) and not a.lora_B.any()
    assert torch.equal(_step_logits(one, IDS), _step_logits(base, IDS))
    with pytest.raises(RlttError, match="other LoRA adapters"):
        attach_adapters(two, AdapterSpec(8, 8.0, ALL))


@pytest.mark.parametrize("per_loop", [False, True])
def test_adapters_off_is_the_base_bit_for_bit(per_loop):
    base, model = _with_adapters(per_loop)
    assert not torch.equal(_step_logits(model, IDS), _step_logits(base, IDS))
    with adapters_disabled(model):
        assert torch.equal(_step_logits(model, IDS), _step_logits(base, IDS))
    assert all(layer.lora_enabled for _, layer in adapted(model))  # back on after the block


def test_merged_is_base_plus_scaled_ba_and_computes_the_adapted_function():
    base, model = _with_adapters(False)
    merged = merged_state_dict(model.state_dict(), model.config)
    assert not any("lora_" in k for k in merged)
    for name, layer in adapted(model):
        expected = layer.weight.double() + 2.0 * (layer.lora_B[0].double() @ layer.lora_A[0].double())  # 8/4
        torch.testing.assert_close(merged[name + ".weight"].double(), expected, rtol=0, atol=1e-6)
    merge_adapters_(model)
    assert model.config.lora_rank == 0 and not list(adapted(model))
    _, adapted_model = _with_adapters(False)
    torch.testing.assert_close(_step_logits(model, IDS), _step_logits(adapted_model, IDS), rtol=1e-4, atol=1e-4)


def test_per_loop_adapters_cannot_merge():
    _, model = _with_adapters(True)
    with pytest.raises(RlttError, match="per_loop"):
        merged_state_dict(model.state_dict(), model.config)


def test_a_per_loop_adapter_acts_on_its_loop_only():
    base, model = _with_adapters(True)
    with torch.no_grad():
        for _, layer in adapted(model):
            layer.lora_B[0].zero_()  # only loop 2 (and 3) adapted
            layer.lora_B[2].zero_()
    ours, theirs = _step_logits(model, IDS), _step_logits(base, IDS)
    assert torch.equal(ours[0], theirs[0])  # loop 1 never sees the loop-2 adapter
    assert not torch.equal(ours[1], theirs[1])
    # the loop-2 adapter alone: StepLinear at steps 1 and 3 is the base layer, bit for bit
    name, layer = next(adapted(model))
    x = torch.randn(2, 5, layer.in_features)
    plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x, 1), plain) and torch.equal(layer(x, 3), plain) and not torch.equal(layer(x, 2), plain)
    rows = layer(x, torch.tensor([1, 2]))  # per-row steps pick each row's adapter
    assert torch.equal(rows[0], plain[0])
    torch.testing.assert_close(rows[1], layer(x, 2)[1])


def test_adapter_gradients_are_the_projection_of_the_full_weight_gradient():
    """W_eff = W + s·B A, so dL/dA = s·Bᵀ·G and dL/dB = s·G·Aᵀ with G = dL/dW_eff = dL/dW (the base
    weight's own gradient; a shared adapter and W see the same T loop uses, so both sum the same
    per-loop terms)."""
    _, model = _with_adapters(False)
    model.train()
    model.double()
    out = model(IDS, use_cache=False, output_step_logits=True)
    loss = out.step_logits.log_softmax(-1)[..., :-1, :].gather(-1, IDS[None, :, 1:, None].expand(3, -1, -1, 1)).sum()
    loss.backward()
    for name, layer in adapted(model):
        g, s = layer.weight.grad, layer.lora_scale
        a, b = layer.lora_A[0], layer.lora_B[0]
        torch.testing.assert_close(layer.lora_A.grad[0], s * b.T @ g, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(layer.lora_B.grad[0], s * g @ a.T, rtol=1e-9, atol=1e-12)


def test_freeze_base_leaves_the_adapters_trainable_in_the_model_dtype():
    _, model = _with_adapters(False)
    model.to(torch.bfloat16)
    count = freeze_base(model)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(n.endswith(("lora_A", "lora_B")) for n in trained)
    assert count == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_adapter_norms_match_the_dense_update_norm():
    _, model = _with_adapters(True)
    norms = adapter_norms(model)
    for group in ("q_proj", "down_proj"):
        layers = [layer for name, layer in adapted(model) if name.endswith(group)]
        a = [layer.lora_A.detach().double() for layer in layers]
        b = [layer.lora_B.detach().double() for layer in layers]
        dense = sum(float(((bi @ ai) * layer.lora_scale).square().sum()) for ai, bi, layer in zip(a, b, layers)) ** 0.5
        assert norms[f"lora/update_norm/{group}"] == pytest.approx(dense, rel=1e-5)
        assert norms[f"lora/A_norm/{group}"] == pytest.approx(
            sum(float(ai.square().sum()) for ai in a) ** 0.5, rel=1e-6)


@pytest.mark.parametrize("per_loop", [False, True])
def test_peft_folder_layout(tmp_path, per_loop):
    from safetensors.torch import load_file

    _, model = _with_adapters(per_loop)
    write_peft_adapter(model, tmp_path / "adapter", base="base-dir")
    folders = [tmp_path / "adapter" / f"loop_{t}" for t in (1, 2, 3)] if per_loop else [tmp_path / "adapter"]
    for t, folder in enumerate(folders):
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
        assert config["target_modules"] == sorted(ALL)
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
        assert torch.equal(a, model.model.layers[0].self_attn.q_proj.lora_A[t])


def test_peft_loads_the_exported_adapter_onto_the_base_model(tmp_path):
    peft = pytest.importorskip("peft")
    base, model = _with_adapters(False)
    write_peft_adapter(model, tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = loaded(IDS, use_cache=False, output_step_logits=True).step_logits
    torch.testing.assert_close(theirs, _step_logits(model, IDS), rtol=1e-5, atol=1e-5)


def _generate(model, **kw):
    """Greedy decoding's tokens and per-token logits (one-position no-grad forwards after the prompt)."""
    out = model.generate(input_ids=IDS, max_new_tokens=6, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("targets", [ALL, ("v_proj",)])
def test_generate_through_peft_is_the_adapted_models(tmp_path, targets):
    """PEFT wraps q/k/v in its own layer, whose ``weight`` is the base's: decoding keeps the three
    projections' forwards there (never the fused base weights), so the adapters act at every token."""
    peft = pytest.importorskip("peft")
    base, model = _with_adapters(False, targets)
    write_peft_adapter(model, tmp_path / "adapter")
    wrapped = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter")).eval()
    tokens, logits = _generate(wrapped)
    want_tokens, want_logits = _generate(model)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    base_tokens, base_logits = _generate(base)  # the adapter matters: skipping it would show
    assert not torch.equal(base_tokens, tokens) and (base_logits - want_logits).abs().max() > 1e-2
    attn = wrapped.base_model.model.model.layers[0].self_attn
    assert not attn.fusable and attn.fused_weights() is None


def test_a_one_position_no_grad_forward_through_get_peft_model_applies_the_adapter():
    peft = pytest.importorskip("peft")
    base = tiny_model()
    wrapped = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"]))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids = IDS[:, :1]
    with torch.no_grad():
        decoded = wrapped(input_ids=ids, use_cache=False).logits  # the decode path
    with torch.enable_grad():
        trained = wrapped(input_ids=ids, use_cache=False).logits  # three projections, always
    with torch.no_grad():
        plain = base(ids, use_cache=False).logits
    torch.testing.assert_close(decoded, trained.detach(), rtol=1e-6, atol=1e-6)
    assert (decoded - plain).abs().max() > 1e-3


def test_peft_and_auto_peft_model_load_the_adapter_folder(tmp_path):
    """The folder names its base (``base_model_name_or_path``) and ``task_type: CAUSAL_LM``:
    ``AutoPeftModelForCausalLM`` loads the base by that name (rltt's model registers with
    transformers' Auto classes) and the adapter onto it."""
    peft = pytest.importorskip("peft")
    base, model = _with_adapters(False)
    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    write_peft_adapter(model, tmp_path / "adapter", base=str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == str(tmp_path / "base")
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    loaded = peft.PeftModel.from_pretrained(load_looped(tmp_path / "base"), str(tmp_path / "adapter")).eval()
    want = _step_logits(model, IDS)
    for wrapped in (auto, loaded):
        assert isinstance(wrapped, peft.PeftModelForCausalLM)
        with torch.no_grad():
            got = wrapped(input_ids=IDS, use_cache=False, output_step_logits=True).step_logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(_generate(auto)[0], _generate(model)[0])


def test_an_rltt_or_ouro_base_is_named_as_the_adapters_base(tmp_path):
    """A run's policy keeps the folder it loaded from as ``name_or_path`` — an rltt model or an Ouro
    checkpoint — which its checkpoints' adapter names as the base."""
    from .test_ouro_import import write_ouro_checkpoint

    tiny_model().save_pretrained(tmp_path / "rltt", safe_serialization=True)
    write_ouro_checkpoint(tmp_path / "ouro")
    assert load_ouro(tmp_path / "ouro").name_or_path == str(tmp_path / "ouro")
    for source in ("rltt", "ouro"):
        model = load_looped(tmp_path / source)
        attach_adapters(model, AdapterSpec(2, 4.0, ("q_proj",)))
        write_peft_adapter(model, tmp_path / f"{source}-adapter", base=model.config._name_or_path)  # as the learner
        config = json.loads((tmp_path / f"{source}-adapter" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(tmp_path / source), source


def test_merged_model_exports_in_rltt_and_ouro_formats(tmp_path):
    _, model = _with_adapters(False, norm_placement="ouro", injection="none")
    expected = _step_logits(model, IDS)
    merge_adapters_(model)
    model.save_pretrained(tmp_path / "rltt", safe_serialization=True)
    save_ouro(model, tmp_path / "ouro")
    for loaded in (load_looped(tmp_path / "rltt"), load_ouro(tmp_path / "ouro")):
        assert not loaded.config.lora_rank
        torch.testing.assert_close(_step_logits(loaded.eval(), IDS), expected, rtol=1e-4, atol=1e-4)
    assert json.loads((tmp_path / "ouro" / "config.json").read_text())["auto_map"] == {
        "AutoConfig": "ByteDance/Ouro-1.4B--configuration_ouro.OuroConfig",
        "AutoModel": "ByteDance/Ouro-1.4B--modeling_ouro.OuroModel",
        "AutoModelForCausalLM": "ByteDance/Ouro-1.4B--modeling_ouro.OuroForCausalLM"}
    _, unmerged = _with_adapters(False, norm_placement="ouro", injection="none")
    with pytest.raises(RlttError, match="lora_rank=4 .merge the adapters first"):
        save_ouro(unmerged, tmp_path / "no")


def test_transformers_finds_ouros_code_through_the_written_auto_map(tmp_path, monkeypatch):
    """``AutoConfig``/``AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)`` fetch the
    classes the ``auto_map`` names from Ouro's hub repository (here caught before any download)."""
    import transformers.models.auto.configuration_auto as configuration_auto
    from transformers import AutoConfig

    asked = []

    def fetch(class_ref, path, **kwargs):
        asked.append(class_ref)
        raise LookupError("no download in tests")

    monkeypatch.setattr(configuration_auto, "get_class_from_dynamic_module", fetch)
    model = tiny_model(norm_placement="ouro", injection="none")
    save_ouro(model, tmp_path / "ouro")
    with pytest.raises(LookupError):
        AutoConfig.from_pretrained(tmp_path / "ouro", trust_remote_code=True)
    assert asked == [OURO_AUTO_MAP["AutoConfig"]]


@pytest.mark.parametrize("overrides, field", [
    (dict(norm_placement="pre"), "norm_placement='pre'"),
    (dict(norm_placement="sandwich", carry_normed_state=False), "carry_normed_state=False"),
    (dict(norm_placement="ouro", injection="scalar"), "injection='scalar'"),
])
def test_ouros_format_refuses_another_layout_naming_the_field(tmp_path, overrides, field):
    with pytest.raises(RlttError, match=f"^save_ouro: Ouro's format cannot express {field} ") as error:
        save_ouro(tiny_model(**overrides), tmp_path / "no")
    assert "merge" not in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "no").exists()
