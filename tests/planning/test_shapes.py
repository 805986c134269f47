"""Shapes from config.json alone: the exact parameter count (against the instantiated model for
rltt, Ouro and dense-to-convert configs) and the KV bytes per token."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rltt.errors import RlttError
from rltt.model.modeling import LoopedForCausalLM
from rltt.planning.shapes import loop_config_from_json, model_shape
from rltt.planning.sources import model_config
from tests.planning.helpers import OURO_1_4B, config_folder


def test_ouro_1_4b_from_a_config_only_folder(tmp_path):
    folder = config_folder(tmp_path, OURO_1_4B)
    config, _ = model_config(str(folder))
    shape = model_shape(config)
    V, d, F, L, T, H, D = 49152, 2048, 5632, 24, 4, 16, 128
    embeddings = 2 * V * d  # untied: embedding + LM head
    attention = 4 * d * (H * D)  # q, k, v, o (no biases)
    mlp = 3 * d * F
    norms = 4 * d  # Ouro's sandwich norms
    expected = embeddings + L * (attention + mlp + norms) + d + (d + 1)  # + final norm + exit gate
    assert expected == 1_434_652_673
    assert shape.parameters == expected
    assert shape.kv_bytes_per_token(2) == T * L * 2 * H * D * 2 == 786_432
    assert (shape.kind, shape.loops, shape.layers) == ("ouro", 4, 24)


def test_an_rltt_config_saved_by_save_pretrained(tmp_path):
    from rltt.model import LoopConfig

    config = LoopConfig(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
                        num_loops=3, injection="scalar", tie_word_embeddings=True)
    config.save_pretrained(tmp_path / "rltt")
    loaded, _ = model_config(str(tmp_path / "rltt"))
    assert loaded["model_type"] == "rltt_looped"
    assert model_shape(loaded).parameters == sum(p.numel() for p in LoopedForCausalLM(config).parameters())


def test_a_folder_without_config_json_is_one_line(tmp_path):
    with pytest.raises(RlttError, match="no config.json"):
        model_config(str(tmp_path))


def test_unsupported_model_type_is_one_line():
    with pytest.raises(RlttError, match="unsupported model_type"):
        model_shape({"model_type": "gpt2"})


def _instantiated(config: dict, convert: dict | None = None) -> int:
    loop_config, _ = loop_config_from_json(config, convert)
    return sum(p.numel() for p in LoopedForCausalLM(loop_config).parameters())


SMALL = dict(vocab_size=st.integers(16, 120), hidden=st.sampled_from([16, 32, 48]), heads=st.sampled_from([1, 2, 4]),
             kv_div=st.sampled_from([1, 2]), layers=st.integers(1, 3), ffn=st.integers(8, 64), loops=st.integers(1, 4),
             tied=st.booleans())


def _geometry(draw_heads, kv_div, hidden):
    kv = max(1, draw_heads // kv_div)
    return draw_heads, kv, hidden // draw_heads if (hidden // draw_heads) % 2 == 0 else 8


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SMALL, placement=st.sampled_from(["pre", "post", "sandwich", "ouro"]),
       injection=st.sampled_from(["none", "scalar"]), qk_norm=st.booleans(), bias=st.booleans(), mlp_bias=st.booleans(),
       final_norm=st.sampled_from(["rmsnorm", "none"]), lora=st.sampled_from([0, 2]))
def test_rltt_config_count_equals_the_model(vocab_size, hidden, heads, kv_div, layers, ffn, loops, tied, placement,
                                            injection, qk_norm, bias, mlp_bias, final_norm, lora):
    heads, kv, head_dim = _geometry(heads, kv_div, hidden)
    config = dict(model_type="rltt_looped", vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                  num_loops=loops, tie_word_embeddings=tied, norm_placement=placement, injection=injection,
                  qk_norm=qk_norm, attention_bias=bias, mlp_bias=mlp_bias, final_norm=final_norm, lora_rank=lora,
                  lora_targets=["q_proj", "o_proj", "down_proj"])
    assert model_shape(config).parameters == _instantiated(config)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SMALL, bias=st.booleans())
def test_ouro_config_count_equals_the_model(vocab_size, hidden, heads, kv_div, layers, ffn, loops, tied, bias):
    heads, kv, head_dim = _geometry(heads, kv_div, hidden)
    config = dict(model_type="ouro", vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                  total_ut_steps=loops, tie_word_embeddings=tied, attention_bias=bias)
    assert model_shape(config).parameters == _instantiated(config)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**SMALL, kind=st.sampled_from(["qwen3", "qwen2", "llama", "mistral"]), bias=st.booleans(),
       injection=st.sampled_from(["none", "scalar"]))
def test_dense_config_to_convert_count_equals_the_model(vocab_size, hidden, heads, kv_div, layers, ffn, loops, tied,
                                                        kind, bias, injection):
    heads, kv, head_dim = _geometry(heads, kv_div, hidden)
    config = dict(model_type=kind, vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                  tie_word_embeddings=tied, max_position_embeddings=128)
    if kind == "llama":
        config.update(attention_bias=bias, mlp_bias=bias)
    if kind == "mistral":
        config["sliding_window"] = None  # loopify supports full attention only
    convert = {"num_loops": loops, "injection": injection}
    shape = model_shape(config, convert)
    assert (shape.kind, shape.loops, shape.injection) == ("dense", loops, injection == "scalar")
    assert shape.parameters == _instantiated(config, convert)


def test_dense_convert_defaults_are_loopify_s():
    config = dict(model_type="qwen3", vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    shape = model_shape(config)  # loopify: num_loops=3, injection=scalar
    assert (shape.loops, shape.injection, shape.qk_norm) == (3, True, True)
    with pytest.raises(RlttError, match="model.convert.num_layers"):
        model_shape(config, {"num_layers": 2})


def test_kv_bytes_per_token_counts_kv_heads():
    config = dict(model_type="qwen3", vocab_size=50, hidden_size=64, intermediate_size=40, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    shape = model_shape(config, {"num_loops": 2})
    assert shape.kv_bytes_per_token(4) == 2 * 3 * 2 * 2 * 16 * 4
