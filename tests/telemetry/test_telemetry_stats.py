import math

import pytest
import torch
from torch import nn

from rltt.telemetry.stats import (
    entropy_stats,
    exit_stats,
    grad_norms,
    mismatch_stats,
    peak_memory_gb,
    reset_peak_memory,
)


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Module()
        self.mlp.up_proj = nn.Linear(d, d, bias=False)
        self.input_layernorm = nn.LayerNorm(d)


class Inner(nn.Module):
    def __init__(self, d=4, vocab=11, layers=3):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.exit_gate = nn.Linear(d, 1)
        self.injection = nn.Module()
        self.injection.logit = nn.Parameter(torch.tensor(4.6))


class TinyLooped(nn.Module):
    """Parameter names as in the looped model: model.embed_tokens..., lm_head.weight."""

    def __init__(self):
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(4, 11, bias=False)


def fill_grads(model):
    """Give every parameter a known gradient: all entries equal to a per-parameter value."""
    values = {}
    for k, (name, p) in enumerate(model.named_parameters()):
        value = 0.1 * (k + 1)
        p.grad = torch.full_like(p, value)
        values[name] = value
    return values


def expected_norm(model, values, predicate):
    return math.sqrt(sum(values[n] ** 2 * p.numel() for n, p in model.named_parameters()
                         if predicate(n)))


def test_grad_norms_total_groups_and_layers():
    model = TinyLooped()
    values = fill_grads(model)
    out = grad_norms(model)
    assert out["grad_norm/total"] == pytest.approx(expected_norm(model, values, lambda n: True),
                                                   rel=1e-5)
    checks = {
        "embed": lambda n: n.startswith("model.embed_tokens."),
        "block": lambda n: n.startswith("model.layers."),
        "injection": lambda n: n.startswith("model.injection."),
        "gate": lambda n: n.startswith("model.exit_gate."),
        "norm": lambda n: n.startswith("model.norm."),
        "lm_head": lambda n: n.startswith("lm_head."),
    }
    for group, predicate in checks.items():
        assert out[f"grad_norm/group/{group}"] == pytest.approx(
            expected_norm(model, values, predicate), rel=1e-5), group
    for i in range(3):
        assert out[f"grad_norm/layer/{i}"] == pytest.approx(
            expected_norm(model, values, lambda n: n.startswith(f"model.layers.{i}.")), rel=1e-5)
    assert "grad_norm/layer/3" not in out
    assert "grad_norm/group/other" not in out
    # groups partition the parameters: squares add up to the total
    group_sq = sum(v ** 2 for k, v in out.items() if k.startswith("grad_norm/group/"))
    assert group_sq == pytest.approx(out["grad_norm/total"] ** 2, rel=1e-5)


def test_grad_norms_custom_groups_wrapper_prefix_and_missing_grads():
    model = TinyLooped()
    wrapped = nn.Module()
    wrapped.module = model  # DDP-style "module." prefix
    values = fill_grads(model)
    model.lm_head.weight.grad = None
    out = grad_norms(wrapped, groups={"attn": lambda n: ".self_attn." in n,
                                      "head": ["lm_head"]}, layer_pattern=None)
    assert "grad_norm/group/head" not in out  # no gradient → omitted
    assert out["grad_norm/group/attn"] == pytest.approx(
        expected_norm(model, values, lambda n: ".self_attn." in n), rel=1e-5)
    assert out["grad_norm/group/other"] > 0
    assert not any(k.startswith("grad_norm/layer/") for k in out)
    assert grad_norms(nn.Linear(2, 2)) == {}


def test_grad_norms_from_a_real_backward():
    model = TinyLooped()
    x = model.model.embed_tokens(torch.tensor([1, 2, 3]))
    for layer in model.model.layers:
        x = x + layer.mlp.up_proj(layer.input_layernorm(x))
    model.lm_head(model.model.norm(x)).logsumexp(-1).sum().backward()
    out = grad_norms(model)
    assert out["grad_norm/total"] > 0
    assert {"grad_norm/layer/0", "grad_norm/layer/2", "grad_norm/group/block"} <= set(out)
    assert "grad_norm/group/gate" not in out  # the gate was not used: no grad


def test_exit_stats_values_and_mask():
    # T = 3 loops, 2 sequences x 2 tokens; the last token of sequence 1 is padding
    p = torch.tensor([
        [[0.95, 0.2], [0.5, 0.0]],
        [[0.05, 0.3], [0.25, 1.0]],
        [[0.00, 0.5], [0.25, 0.0]],
    ])
    mask = torch.tensor([[1, 1], [1, 0]])
    out = exit_stats(p, mask)
    assert out["exit/p_1"] == pytest.approx((0.95 + 0.2 + 0.5) / 3)
    assert out["exit/p_2"] == pytest.approx((0.05 + 0.3 + 0.25) / 3)
    assert out["exit/p_3"] == pytest.approx((0.0 + 0.5 + 0.25) / 3)
    assert sum(out[f"exit/p_{t}"] for t in (1, 2, 3)) == pytest.approx(1.0)
    steps = [1 * 0.95 + 2 * 0.05, 0.2 + 0.6 + 1.5, 0.5 + 0.5 + 0.75]
    assert out["exit/mean_step"] == pytest.approx(sum(steps) / 3)
    assert out["exit/collapse"] == pytest.approx(1 / 3)  # only the 0.95 token
    h = [-(0.95 * math.log(0.95) + 0.05 * math.log(0.05)),
         -(0.2 * math.log(0.2) + 0.3 * math.log(0.3) + 0.5 * math.log(0.5)),
         -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))]
    assert out["exit/entropy"] == pytest.approx(sum(h) / 3, rel=1e-4)
    # without a mask the padding token counts
    assert exit_stats(p)["exit/p_2"] == pytest.approx((0.05 + 0.3 + 0.25 + 1.0) / 4)


def test_exit_stats_full_collapse_and_single_loop():
    p = torch.zeros(4, 5)
    p[0] = 1.0
    out = exit_stats(p)
    assert out["exit/collapse"] == 1.0 and out["exit/mean_step"] == 1.0
    assert out["exit/p_4"] == 0.0
    assert exit_stats(torch.ones(1, 3))["exit/p_1"] == 1.0


def test_entropy_and_mismatch_stats():
    ent = torch.tensor([[1.0, 3.0], [0.5, 0.7]])
    assert entropy_stats(ent, torch.tensor([1, 0])) == {"entropy/loop_1": 1.0,
                                                       "entropy/loop_2": 0.5}
    learner = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64)
    sampler = torch.tensor([-1.0, -2.1, -9.0], dtype=torch.float64)
    out = mismatch_stats(learner, sampler, torch.tensor([1, 1, 0]))
    assert out["mismatch/max_abs"] == pytest.approx(0.1)
    assert out["mismatch/mean_abs"] == pytest.approx(0.05)
    assert out["mismatch/k3"] == pytest.approx((math.exp(0.1) - 1 - 0.1) / 2)
    assert mismatch_stats(learner, learner)["mismatch/k3"] == 0.0


def test_peak_memory_is_positive_gib():
    value = peak_memory_gb("cpu")
    assert 0.01 < value < 1024


def test_cuda_peak_restarts_at_reset(monkeypatch):
    """On CUDA `peak_memory_gb` reads the allocator's peak since the last `reset_peak_memory` (the
    trainers reset after each record, so ``memory/peak_gb`` is a step's peak); emulated allocator."""
    gib = 1024**3
    state = {"now": 2 * gib, "peak": 9 * gib}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=state["now"]))
    assert peak_memory_gb() == 9.0
    reset_peak_memory()
    assert peak_memory_gb() == 2.0
    state.update(peak=5 * gib)
    assert peak_memory_gb("cuda") == 5.0
    reset_peak_memory("cpu")  # not a CUDA device: the peak is left alone
    assert peak_memory_gb("cuda") == 5.0
