"""T = 1 looped models converted from transformers' own Qwen3 / Qwen2 / Llama equal them exactly."""

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from rltt.model import LoopedForCausalLM, load_looped, loopify

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def dense(kind: str):
    torch.manual_seed(1)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON))
    else:
        model = LlamaForCausalLM(LlamaConfig(**COMMON, attention_bias=True))
    # random norm weights/biases so that every parameter matters
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith("bias"):
            p.data.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_t1_full_forward_equals_dense_exactly(kind):
    hf = dense(kind)
    looped = loopify(hf, num_loops=1, injection="none").eval()
    ids = torch.randint(0, COMMON["vocab_size"], (3, 11))
    with torch.no_grad():
        assert torch.equal(looped(ids, use_cache=False).logits, hf(ids, use_cache=False).logits)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_t1_cached_decoding_equals_dense_exactly(kind):
    hf = dense(kind)
    looped = loopify(hf, num_loops=1, injection="none").eval()
    ids = torch.randint(0, COMMON["vocab_size"], (2, 9))
    with torch.no_grad():
        a = looped(ids[:, :5], use_cache=True)
        b = hf(ids[:, :5], use_cache=True)
        assert torch.equal(a.logits, b.logits)
        for j in range(5, 9):
            a = looped(ids[:, j:j + 1], past_key_values=a.past_key_values, use_cache=True)
            b = hf(ids[:, j:j + 1], past_key_values=b.past_key_values, use_cache=True)
            assert torch.equal(a.logits, b.logits), f"token {j}"
        gen_a = looped.generate(ids[:, :4], max_new_tokens=6, do_sample=False)
        gen_b = hf.generate(ids[:, :4], max_new_tokens=6, do_sample=False)
    assert torch.equal(gen_a, gen_b)


def test_convert_from_local_path_and_save_round_trip(tmp_path):
    hf = dense("qwen3")
    hf.save_pretrained(tmp_path / "dense")
    looped = load_looped(tmp_path / "dense", num_loops=1, injection="none").eval()
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7))
    with torch.no_grad():
        assert torch.equal(looped(ids, use_cache=False).logits, hf(ids, use_cache=False).logits)


def test_multi_loop_conversion_adds_loop_parts_only():
    hf = dense("qwen3")
    looped = loopify(hf, num_loops=3, injection="scalar", gate_bias=-1.0)
    assert looped.config.num_loops == 3
    assert torch.sigmoid(looped.model.injection_logit).item() == pytest.approx(0.99, abs=0.001)
    assert torch.equal(looped.model.layers[0].self_attn.q_proj.weight, hf.model.layers[0].self_attn.q_proj.weight)
    assert isinstance(looped, LoopedForCausalLM)
    with torch.no_grad():
        out = looped(torch.randint(0, 101, (1, 5)), use_cache=False)
    expected = torch.sigmoid(torch.tensor(-1.0))
    assert torch.allclose(out.gate_probs, expected.expand_as(out.gate_probs))
