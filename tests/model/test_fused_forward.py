"""Decoding's fused q/k/v projection and the one-operator RMSNorm compute the same function, bit for bit.

The reference is the layer arithmetic as it was written before (three projections, RoPE of q and of
k, transformers' RMSNorm formula), patched into the model: prefill, cached decode, the learner's
full-sequence forward (values and gradients) and native rollouts (every recorded field) must equal
it exactly, in fp32 and bf16. Then what the fusion is for: fewer operators per layer call, counted
with the profiler.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from rltt.model import LoopedForCausalLM
from rltt.model.layers import Attention, FusedWeights, RMSNorm, apply_rotary, fusion_is_exact
from rltt.rollout import NativeEngine, SamplingParams
from rltt.rollout.host_work import profile_host_work, rollout_host_work
from tests.rollout.helpers import prompts, tiny_model

from .helpers import tiny_config

DTYPES = [torch.float32, torch.bfloat16]
VARIANTS = {"gqa": {}, "mha": dict(num_key_value_heads=4), "qk_norm+bias": dict(qk_norm=True, attention_bias=True),
            "ouro": dict(norm_placement="ouro")}


def reference_rms_norm(self, x):
    """transformers' RMSNorm, operation for operation."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(dtype)


def reference_qkv(self, x, cos, sin, step=1):
    """Three projections, each head set viewed and transposed, q and k normed and rotated apart."""
    b, s, _ = x.shape
    q = self.q_proj(x, step).view(b, s, -1, self.head_dim)
    k = self.k_proj(x, step).view(b, s, -1, self.head_dim)
    v = self.v_proj(x, step).view(b, s, -1, self.head_dim).transpose(1, 2)
    if self.q_norm is not None:
        q, k = self.q_norm(q), self.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


@pytest.fixture
def reference(monkeypatch):
    """Run the model with the reference arithmetic while the fixture's ``on()`` is in force."""
    class Switch:
        def on(self):
            monkeypatch.setattr(RMSNorm, "forward", reference_rms_norm)
            monkeypatch.setattr(Attention, "qkv", reference_qkv)

        def off(self):
            monkeypatch.undo()
    return Switch()


def _model(dtype, **overrides):
    model = tiny_model(dtype=dtype, **overrides)
    torch.manual_seed(7)
    with torch.no_grad():  # norms and biases away from their initial values, so every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


def _ids(rows=3, length=9):
    return torch.randint(1, 61, (rows, length), generator=torch.Generator().manual_seed(3))


def _prefill_and_decode(model):
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    with torch.no_grad():
        prefill = model(ids, attention_mask=mask, use_cache=True, output_step_logits=True)
        cache, logits = prefill.past_key_values, [prefill.step_logits]
        token = prefill.logits[:, -1:].argmax(-1)
        for _ in range(2):  # one position per row: the fused path
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            out = model(token, attention_mask=mask, past_key_values=cache, use_cache=True, output_step_logits=True)
            logits.append(out.step_logits)
            token = out.logits.argmax(-1)
    return logits


def _score(model):
    """The learner's full-sequence forward: per-loop log-probs and their gradients."""
    model.zero_grad()
    ids = _ids()
    score_mask = torch.zeros_like(ids, dtype=torch.bool)
    score_mask[:, 4:] = True
    out = model(ids, attention_mask=torch.ones_like(ids), score_mask=score_mask)
    out.token_logprobs.float().sum().backward()
    return out.token_logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rollout(model, schedule):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=4, n=2, seed=5, exit_policy="sample",
                            schedule=schedule)
    batch = NativeEngine(model).generate(prompts([3, 6], seed=2), params)
    fields = [batch.completion_ids, batch.exit_steps, batch.logprobs, batch.tempered_logprobs,
              batch.gate_probs.nan_to_num(-1.0), batch.exit_logprobs, batch.kept_floor]
    return fields + [t for p in batch.schedule.passes for t in (p.work, p.exits)]


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype,variant", [(torch.float32, "gqa"), (torch.bfloat16, "mha"),
                                           (torch.bfloat16, "qk_norm+bias"), (torch.float32, "ouro")])
def test_prefill_decode_and_the_learner_forward_equal_the_reference(reference, dtype, variant):
    model = _model(dtype, **VARIANTS[variant])
    got = (_prefill_and_decode(model), _score(model))
    assert model.model.layers[0].self_attn.fused_qkv.weight is not None  # decoding took the fused path
    reference.on()
    want = (_prefill_and_decode(model), _score(model))
    assert _equal(got, want)


@pytest.mark.parametrize("dtype,schedule,variant", [
    (torch.float32, "dense", "gqa"), (torch.bfloat16, "deferred", "qk_norm+bias"),
    (torch.bfloat16, "deferred", "gqa"), (torch.float32, "deferred", "qk_norm+bias")])
def test_native_rollouts_equal_the_reference(reference, dtype, schedule, variant):
    model = _model(dtype, **VARIANTS[variant])
    got = _rollout(model, schedule)
    reference.on()
    assert _equal(got, _rollout(model, schedule))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 64), (8, 1, 128), (3, 17, 48), (2, 4, 5, 16)])
def test_rms_norm_equals_transformers_formula(dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    for weight_dtype in {dtype, torch.float32}:
        norm = RMSNorm(shape[-1]).to(weight_dtype)
        norm.weight.data.normal_(1.0, 0.3)
        assert _equal(norm(x), reference_rms_norm(norm, x))
        assert _equal(norm(x[..., 1:, :]), reference_rms_norm(norm, x[..., 1:, :]))  # a strided view


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("sizes", [(64, (64, 32, 32)), (128, (1024, 256, 256)), (48, (48, 48, 48)),
                                   (896, (896, 128, 128))])
def test_one_gemm_over_concatenated_weights_equals_the_separate_gemms(dtype, rows, sizes):
    """What the fusion rests on: each output element is the same dot product, in the same order. That
    is true of many CPUs' GEMMs but not of all (an AVX-512/AMX machine's bf16 GEMM at d = 896 over
    300 rows is not), so decoding fuses only where `fusion_is_exact` measured it: wherever it says
    so, the fused GEMM equals the separate ones here, with and without biases; and the common fp32
    shapes do fuse (the check is not vacuous)."""
    d, outs = sizes
    torch.manual_seed(rows)
    x = torch.randn(rows, 1, d).to(dtype)
    weights = [(torch.randn(o, d) * d**-0.5).to(dtype) for o in outs]
    biases = [torch.randn(o).to(dtype) for o in outs]
    for bias in (None, torch.cat(biases)):
        if not fusion_is_exact(d, outs, bias is not None, dtype):
            continue  # decoding keeps three GEMMs for this shape on this machine
        split = [F.linear(x, w, None if bias is None else b) for w, b in zip(weights, biases)]
        fused = F.linear(x, torch.cat(weights), bias).split(list(outs), -1)
        assert _equal(list(fused), split)
    if dtype == torch.float32 and d <= 128:
        assert fusion_is_exact(d, outs, False, dtype) and fusion_is_exact(d, outs, True, dtype)


def test_a_shape_whose_fused_gemm_is_not_exact_decodes_with_three_projections(monkeypatch):
    """Where the check fails, the layer's decode keeps three GEMMs — and so equals the reference."""
    import rltt.model.layers as layers

    model = tiny_model()
    attn = model.model.layers[0].self_attn
    assert attn.fused_weights() is not None
    monkeypatch.setattr(layers, "fusion_is_exact", lambda *a: False)
    assert attn.fused_weights() is None


def test_the_cache_follows_weight_updates_and_conversions():
    model = _model(torch.float32)
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 1, model.config.hidden_size)
    positions = torch.arange(3)[:, None]
    cos, sin = model.model.rotary_emb(positions, x.dtype)

    def decode():
        with torch.no_grad():
            return attn.qkv(x, cos, sin)

    def split():
        return reference_qkv(attn, x, cos, sin)

    assert _equal(decode(), split())
    built = attn.fused_qkv.weight
    with torch.no_grad():  # an optimizer-like in-place step: the version counter moves
        attn.k_proj.weight.add_(0.5)
    assert _equal(decode(), split()) and attn.fused_qkv.weight is built  # refreshed in place
    state = {k: v + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert _equal(decode(), split())
    model.load_state_dict({k: v * 2 for k, v in state.items()}, assign=True)  # new parameter tensors
    assert _equal(decode(), split())
    clone = copy.deepcopy(model)
    assert clone.model.layers[0].self_attn.fused_qkv.weight is None  # never copied
    model.to(torch.bfloat16)
    assert attn.fused_qkv.weight is None  # dropped by the conversion, rebuilt in the new dtype
    x = x.to(torch.bfloat16)
    assert _equal(decode(), split()) and attn.fused_qkv.weight.dtype == torch.bfloat16


def test_lora_on_q_k_or_v_keeps_three_projections():
    assert LoopedForCausalLM(tiny_config(lora_rank=2)).model.layers[0].self_attn.fused_weights() is None
    mlp_only = LoopedForCausalLM(tiny_config(lora_rank=2, lora_targets=["o_proj", "gate_proj"]))
    assert mlp_only.model.layers[0].self_attn.fused_weights() is not None
    assert FusedWeights().nbytes() == 0


def test_fused_bytes_are_the_plans():
    """`LoopedModel.fused_bytes` after decoding is what `ModelShape.fused_parameters` counts."""
    from rltt.planning.shapes import ModelShape

    for overrides in (dict(attention_bias=True, lora_rank=2, lora_targets=["up_proj"]), dict(lora_rank=2)):
        model = tiny_model(num_loops=2, **overrides).to(torch.bfloat16)
        NativeEngine(model).generate(prompts([3]), SamplingParams(temperature=0, max_new_tokens=1))
        planned = ModelShape.of(model.config).fused_parameters * 2
        assert model.model.fused_bytes() == planned


# -- operators per layer call ------------------------------------------------------------------
DECODE_LAYER_OPERATORS = {torch.float32: 19, torch.bfloat16: 21}  # before: 25 and 37


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_layer_call_dispatches_at_most_the_stated_operators(dtype):
    """A pre-norm layer at one position per row, attention excluded (``attend`` returns a tensor): rms_norm,
    1 q/k/v GEMM, view, split, RoPE (mul, roll, mul, add), split; reshape, o_proj, add; rms_norm,
    gate, silu, up, mul, down, add — 19 top-level operators in fp32, 21 in bf16 (two per norm)."""
    model = tiny_model(dtype=dtype)
    layer = model.model.layers[0]
    x = torch.randn(8, 1, model.config.hidden_size).to(dtype)
    cos, sin = model.model.rotary_emb(torch.arange(8)[:, None], dtype)
    cfg = model.config
    attention_out = torch.zeros(8, cfg.num_attention_heads, 1, cfg.head_dim, dtype=dtype)  # contiguous, as SDPA's

    def call():
        return layer(x, cos, sin, lambda q, k, v, i: attention_out)

    with torch.no_grad():
        call()  # builds the fused weights
        _, work = profile_host_work(call, layers=1, passes=lambda _: 1)
    assert work.operators <= DECODE_LAYER_OPERATORS[dtype], work.top_ops


#: operators per (layer · pass) of a native rollout at one layer more — the layer's own share, the
#: engine's attention included (this test's rollouts: 31.2 dense, 43.1 deferred; 37.2 and 49.1 with
#: three q/k/v projections)
ROLLOUT_LAYER_OPERATORS = {"dense": 32, "deferred": 44}


@pytest.mark.parametrize("schedule", ["dense", "deferred"])
def test_operators_per_layer_pass_of_a_rollout(schedule):
    params = SamplingParams(temperature=0, max_new_tokens=5, exit_policy="sample", schedule=schedule, seed=1)
    counted = {}
    for layers in (2, 3):
        model = tiny_model(num_hidden_layers=layers)
        with torch.no_grad():  # exits drawn from the same gate at every depth: the same passes
            model.model.exit_gate.weight.zero_()
        counted[layers] = rollout_host_work(NativeEngine(model), prompts([5, 3, 4]), params)[1]
    assert counted[2].passes == counted[3].passes
    per_layer = (counted[3].operators - counted[2].operators) / counted[2].passes
    assert per_layer <= ROLLOUT_LAYER_OPERATORS[schedule], (per_layer, counted[3].top_ops - counted[2].top_ops)


@pytest.mark.parametrize("engine", ["native", "vllm"])
def test_the_plan_counts_the_native_engines_fused_weights(engine):
    from pathlib import Path

    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.planning import plan_run
    from rltt.planning.shapes import model_shape
    from rltt.telemetry.schema import GIB
    from tests.planning.helpers import OURO_1_4B

    recipe = load_train_recipe(Path(__file__).resolve().parents[2] / "recipes" / "gsm8k.yaml", [
        "model.path=quickstart", f"rollout.engine={engine}", "model.dtype=bf16", "learner.dtype=bf16",
        "learner.backend=torch", "rollout.schedule=dense"])
    plan = plan_run(recipe, OURO_1_4B, 80 * GIB, device="cuda")
    expected = 2 * model_shape(OURO_1_4B).fused_parameters if engine == "native" else 0
    assert plan.components["engine_fused"] == expected
    assert engine == "vllm" or expected == 2 * 24 * (3 * 2048) * 2048  # Ouro-1.4B: L·(q + 2·kv)·d, bf16
