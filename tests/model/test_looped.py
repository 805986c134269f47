"""The looped forward: exits, per-step outputs, KV cache, save/load, LoRA, bad configs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from rltt.errors import ConfigError
from rltt.model import ExitPolicy, LoopConfig, LoopedForCausalLM, exit_distribution

from .helpers import tiny_config, tiny_model


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_exit_distribution_is_the_survival_formula(num_loops, n, seed):
    gen = torch.Generator().manual_seed(seed)
    lam = torch.rand(num_loops, n, generator=gen)
    p = exit_distribution(lam)
    assert torch.allclose(p.sum(0), torch.ones(n), atol=1e-6)
    for t in range(num_loops):
        survive = torch.ones(n)
        for s in range(t):
            survive = survive * (1 - lam[s])
        expected = survive if t == num_loops - 1 else lam[t] * survive
        assert torch.allclose(p[t], expected, atol=1e-6)


def test_exit_policies_pick_the_specified_step():
    p = torch.tensor([[0.1, 0.5], [0.3, 0.2], [0.4, 0.1], [0.2, 0.2]])  # (T=4, 2)
    T = 4
    assert ExitPolicy.parse("final", T).choose(p).tolist() == [4, 4]
    assert ExitPolicy.parse("fixed:2", T).choose(p).tolist() == [2, 2]
    # CDF col0: .1 .4 .8 1.0 ; col1: .5 .7 .8 1.0
    assert ExitPolicy.parse("threshold:0.5", T).choose(p).tolist() == [3, 1]
    assert ExitPolicy.parse("threshold:0.75", T).choose(p).tolist() == [3, 3]
    assert ExitPolicy.parse("threshold:1.0", T).choose(p).tolist() == [4, 4]
    gen = torch.Generator().manual_seed(0)
    one_hot = torch.tensor([[0.0], [1.0], [0.0], [0.0]])
    assert ExitPolicy.parse("sample", T).choose(one_hot.expand(4, 500), gen).unique().tolist() == [2]
    samples = ExitPolicy.parse("sample", T).choose(p[:, :1].expand(4, 20000).contiguous(), gen)
    freq = torch.bincount(samples, minlength=5)[1:].float() / 20000
    assert torch.allclose(freq, p[:, 0], atol=0.02)


@pytest.mark.parametrize("policy", ["final", "fixed:1", "fixed:2", "threshold:0.6", "sample"])
def test_forward_returns_the_logits_of_the_exit_step(policy):
    model = tiny_model()
    ids = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        out = model(ids, use_cache=False, exit_policy=policy, output_step_logits=True,
                    generator=torch.Generator().manual_seed(0))
    T = model.config.num_loops
    assert out.step_logits.shape == (T, 2, 6, 97)
    picked = out.step_logits.gather(0, (out.exit_steps - 1)[None, :, :, None].expand(1, 2, 6, 97))[0]
    assert torch.equal(out.logits, picked)
    expected = ExitPolicy.parse(policy, T)
    if expected.kind == "fixed":
        assert (out.exit_steps == expected.value).all()
    if expected.kind == "threshold":
        assert torch.equal(out.exit_steps, expected.choose(out.exit_probs))


@pytest.mark.parametrize("num_loops", [1, 3, 4])
@pytest.mark.parametrize("variant", [dict(), dict(injection="scalar", norm_placement="sandwich"),
                                     dict(norm_placement="ouro"), dict(norm_placement="post", carry_normed_state=False),
                                     dict(lora_rank=2, final_norm="none")])
def test_cached_decode_equals_full_forward(num_loops, variant):
    model = tiny_model(num_loops=num_loops, **variant)
    if model.config.lora_rank:
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.data.normal_(0, 0.05)
    ids = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        full = model(ids, use_cache=False, output_step_logits=True)
        out = model(ids[:, :4], use_cache=True, output_step_logits=True)
        steps, gates = [out.step_logits], [out.gate_probs]
        for j in range(4, 10):
            out = model(ids[:, j:j + 1], past_key_values=out.past_key_values, use_cache=True, output_step_logits=True)
            steps.append(out.step_logits)
            gates.append(out.gate_probs)
    torch.testing.assert_close(torch.cat(steps, 2), full.step_logits, rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(torch.cat(gates, 2), full.gate_probs, rtol=1e-4, atol=5e-5)


def test_generate_equals_greedy_full_forward():
    model = tiny_model(num_loops=3, injection="scalar")
    ids = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        seq = ids
        for _ in range(6):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(gen, seq)


def test_left_padded_batch_matches_unpadded_rows():
    model = tiny_model(num_loops=2)
    a = torch.randint(1, 97, (1, 7))
    b = torch.randint(1, 97, (1, 4))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=mask, use_cache=False).logits
        alone = model(b, use_cache=False).logits
    torch.testing.assert_close(padded[1, 3:], alone[0], rtol=1e-5, atol=1e-5)


def test_injection_formula():
    model = tiny_model(num_loops=3, injection="scalar")
    e = torch.randn(2, 3, 64)
    h = torch.randn(2, 3, 64)
    w = torch.sigmoid(torch.tensor(4.6))
    assert torch.equal(model.model.inject(e, h, 1), e)
    torch.testing.assert_close(model.model.inject(e, h, 2), w * e + (1 - w) * h)
    per_row = model.model.inject(e, h, torch.tensor([1, 3]))
    assert torch.equal(per_row[0], e[0])
    torch.testing.assert_close(per_row[1], w * e[1] + (1 - w) * h[1])


def test_first_step_reads_the_embeddings_for_both_injections():
    e = torch.randn(2, 3, 64)
    h = torch.randn(2, 3, 64)
    none = tiny_model(num_loops=3, injection="none").model
    assert torch.equal(none.inject(e, h, 1), e)  # z_1 = e (h_0 = e)
    assert torch.equal(none.inject(e, h, 2), h)
    per_row = none.inject(e, h, torch.tensor([1, 3]))
    assert torch.equal(per_row[0], e[0]) and torch.equal(per_row[1], h[1])


def test_save_load_round_trip_is_bit_identical(tmp_path):
    model = tiny_model(num_loops=3, injection="scalar", norm_placement="ouro", lora_rank=2)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, LoopedForCausalLM)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    ids = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, loaded(ids, use_cache=False).logits)


def test_lora_off_by_default_and_trainable_when_on():
    plain = tiny_model()
    assert not any("lora" in n for n, _ in plain.named_parameters())
    model = tiny_model(lora_rank=4, lora_targets=["q_proj", "up_proj"])
    names = [n for n, _ in model.named_parameters() if "lora" in n]
    assert any("q_proj.lora_A" in n for n in names) and any("up_proj.lora_B" in n for n in names)
    assert not any("k_proj.lora" in n for n in names)
    ids = torch.randint(0, 97, (2, 5))
    base = model(ids, use_cache=False).logits
    # B starts at zero: LoRA changes nothing until trained
    model.model.layers[0].self_attn.q_proj.lora_B.data.zero_()
    loss = model(ids, use_cache=False).logits.square().mean()
    loss.backward()
    grad = model.model.layers[0].self_attn.q_proj.lora_B.grad
    assert grad is not None and grad.abs().sum() > 0
    assert grad[0].abs().sum() > 0 and grad[-1].abs().sum() > 0  # one adapter per step
    assert torch.isfinite(base).all()


@pytest.mark.parametrize("field,value,match", [
    ("num_loops", 0, "num_loops"),
    ("norm_placement", "middle", "norm_placement"),
    ("injection", "additive", "injection"),
    ("exit_policy", "fixed:9", "exit_policy"),
    ("exit_policy", "threshold:1.5", "exit_policy"),
    ("exit_policy", "sometimes", "exit_policy"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("final_norm", "layernorm", "final_norm"),
    ("lora_targets", ["attn"], "lora_targets"),
])
def test_bad_config_raises_one_line_error_naming_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match) as info:
        tiny_config(**{field: value})
    assert "\n" not in str(info.value)


def test_head_size_that_does_not_divide():
    with pytest.raises(ConfigError, match="hidden_size"):
        LoopConfig(hidden_size=66, num_attention_heads=4)
