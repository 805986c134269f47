"""Ouro checkpoints load by weight-name mapping and match a reference forward written from the formulas."""

import json

import pytest
import torch
from safetensors.torch import save_file

from rltt.errors import RlttError
from rltt.model import load_looped, load_ouro

CFG = dict(model_type="ouro", architectures=["OuroForCausalLM"], vocab_size=83, hidden_size=64,
           intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           hidden_act="silu", max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
           tie_word_embeddings=False, total_ut_steps=3, early_exit_threshold=0.6)


def ouro_state(cfg) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    d, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd

    def rnd(*shape, scale=0.08, mean=0.0):
        return (torch.randn(*shape, generator=g) * scale + mean).contiguous()

    state = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], d, scale=0.5),
             "model.norm.weight": rnd(d, mean=1.0, scale=0.1),
             "model.early_exit_gate.weight": rnd(1, d, scale=0.3),
             "model.early_exit_gate.bias": rnd(1, scale=0.3),
             "lm_head.weight": rnd(cfg["vocab_size"], d, scale=0.2)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": rnd(d, d), p + "self_attn.k_proj.weight": rnd(kv, d),
                      p + "self_attn.v_proj.weight": rnd(kv, d), p + "self_attn.o_proj.weight": rnd(d, d),
                      p + "mlp.gate_proj.weight": rnd(f, d), p + "mlp.up_proj.weight": rnd(f, d),
                      p + "mlp.down_proj.weight": rnd(d, f)})
        for norm in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            state[p + norm + ".weight"] = rnd(d, mean=1.0, scale=0.1)
    return state


def write_ouro_checkpoint(path, cfg=CFG):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    state = ouro_state(cfg)
    save_file(state, str(path / "model.safetensors"))
    return state


def reference_forward(w, cfg, ids):
    """Ouro's forward from the formulas: sandwich-norm layers, final norm after every step (carried)."""
    eps, H, KV = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"]
    hd = d // H

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    S = ids.shape[1]
    pos = torch.arange(S, dtype=torch.float)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    ang = torch.outer(pos, inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(x):  # (B, h, S, hd)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    causal = torch.ones(S, S).tril().bool()

    def attn(x, p):
        B = x.shape[0]
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(B, S, H, hd).transpose(1, 2)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(B, S, KV, hd).transpose(1, 2)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(B, S, KV, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        scores = (q @ k.transpose(-1, -2)) / hd**0.5
        scores = scores.masked_fill(~causal, float("-inf"))
        out = scores.softmax(-1) @ v
        return out.transpose(1, 2).reshape(B, S, d) @ w[p + "self_attn.o_proj.weight"].T

    def mlp(x, p):
        gate = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
        return (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T

    h = w["model.embed_tokens.weight"][ids]
    logits, lams = [], []
    for _ in range(cfg["total_ut_steps"]):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = h + rms(attn(rms(h, w[p + "input_layernorm.weight"]), p), w[p + "input_layernorm_2.weight"])
            h = h + rms(mlp(rms(h, w[p + "post_attention_layernorm.weight"]), p), w[p + "post_attention_layernorm_2.weight"])
        h = rms(h, w["model.norm.weight"])
        logits.append(h @ w["lm_head.weight"].T)
        lams.append(torch.sigmoid(h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"]).squeeze(-1))
    return torch.stack(logits), torch.stack(lams)


def test_ouro_checkpoint_matches_reference_forward(tmp_path):
    state = write_ouro_checkpoint(tmp_path / "ouro")
    model = load_ouro(tmp_path / "ouro")
    assert model.config.num_loops == 3 and model.config.norm_placement == "ouro"
    assert model.config.exit_policy == "threshold:0.6"
    ids = torch.randint(0, CFG["vocab_size"], (2, 9))
    with torch.no_grad():
        out = model(ids, use_cache=False, output_step_logits=True)
        ref_logits, ref_lams = reference_forward(state, CFG, ids)
    torch.testing.assert_close(out.step_logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.gate_probs, ref_lams, rtol=1e-5, atol=1e-5)
    # the default exit policy came from early_exit_threshold
    cdf = out.exit_probs.cumsum(0)
    expected = ((cdf >= 0.6).float().argmax(0) + 1).where((cdf >= 0.6).any(0), torch.tensor(3))
    assert torch.equal(out.exit_steps, expected)


def test_load_looped_dispatches_on_model_type(tmp_path):
    write_ouro_checkpoint(tmp_path / "ouro")
    assert load_looped(tmp_path / "ouro").config.norm_placement == "ouro"


def test_bad_ouro_checkpoints(tmp_path):
    with pytest.raises(RlttError, match="config.json"):
        load_ouro(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**CFG, "model_type": "qwen2"}))
    with pytest.raises(RlttError, match="model_type"):
        load_ouro(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    with pytest.raises(RlttError, match="safetensors"):
        load_ouro(tmp_path)
