"""``learner.lm_head_dtype: fp32``: the LM head's final norm, the head and the per-loop kernel in fp32
on a bf16 learner — closer to an fp32 rollout (lower ``mismatch/*``) — and a no-op on fp32."""

import copy

import pytest
import torch

from rltt.errors import ConfigError
from rltt.learner import AlgorithmConfig, Learner, LearnerBatch, LearnerConfig, score_tokens
from rltt.rollout import NativeEngine, SamplingParams

from tests.rollout.helpers import prompts, tiny_model

from .helpers import synthetic_batch, tiny_policy


def test_fp32_models_are_unchanged_bitwise():
    batch = synthetic_batch()
    runs = []
    for head in ("model", "fp32"):
        model = tiny_policy()
        learner = Learner(model, LearnerConfig(lr=1e-2, micro_batch_size=2, lm_head_dtype=head),
                          AlgorithmConfig(kl_coef=0.1), batch_size=4, max_len=8)
        metrics = {k: v for k, v in learner.update(batch).items() if not k.startswith("perf/")}
        runs.append((metrics, {k: v.clone() for k, v in model.state_dict().items()}))
    (m1, w1), (m2, w2) = runs
    assert m1.keys() == m2.keys() and all(m1[k] == m2[k] or (m1[k] != m1[k] and m2[k] != m2[k]) for k in m1)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_the_fp32_readout_is_the_fp32_norm_and_head_of_the_bf16_states():
    """The head reads ``rmsnorm(s_t)`` in fp32 (never rounded to bf16) — the formula written out from
    the bf16 model's own pre-norm states — while the exit probabilities stay as computed."""
    model = tiny_policy().to(torch.bfloat16)
    batch = synthetic_batch()
    with torch.no_grad():
        plain = score_tokens(model, batch)
        fp32 = score_tokens(model, batch, head_dtype=torch.float32)
        # pre-norm states s_t, from the model's own loop
        inner = model.model
        captured = []
        hook = inner.norm.register_forward_hook(lambda mod, args, out: captured.append(args[0]))
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        hook.remove()
    s = torch.stack(captured[: model.config.num_loops])  # (T, B, S, d) bf16
    x = s.float()
    h = inner.norm.weight.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inner.norm.variance_epsilon)
    predicts = batch.target_mask[:, 1:]
    h = h[:, :, :-1][:, predicts]
    logits = h @ model.lm_head.weight.float().T
    targets = batch.input_ids[:, 1:][predicts]
    want = torch.log_softmax(logits, -1).gather(-1, targets[None, :, None].expand(h.shape[0], -1, 1))[..., 0]
    torch.testing.assert_close(fp32.logprobs, want, atol=2e-5, rtol=2e-5)
    assert not torch.equal(fp32.logprobs, plain.logprobs)
    assert torch.equal(fp32.exit_probs, plain.exit_probs)


@pytest.mark.slow
def test_an_fp32_head_lowers_the_mismatch_of_a_bf16_learner_against_an_fp32_rollout():
    model = tiny_model(hidden_size=64, intermediate_size=128, num_loops=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    served = copy.deepcopy(model).to(torch.bfloat16).float()  # what a bf16 learner serves an fp32 engine
    metrics = {}
    for seed in (1, 2):
        batch = NativeEngine(served).generate(prompts([5, 3, 4, 6], seed=seed),
                                              SamplingParams(max_new_tokens=12, n=4, seed=seed, exit_policy="sample"))
        lb = LearnerBatch.from_rollout(batch, torch.randn(batch.num_rows, generator=torch.Generator().manual_seed(0)))
        for head in ("model", "fp32"):
            learner = Learner(copy.deepcopy(served), LearnerConfig(lr=1e-3, dtype="bf16", lm_head_dtype=head,
                                                                   micro_batch_size=16),
                              AlgorithmConfig(track_kl=False), batch_size=lb.size, max_len=12,
                              rollout_dtype=torch.float32)
            metrics[seed, head] = learner.update(lb)
        # the head's rounding is gone from every token, so the mean mismatch drops; the largest single
        # one (``mismatch/max_abs``) is set by the bf16 body's rounding of one state, which the head's
        # dtype does not touch, and on another CPU code path it came out either way (0.052 vs 0.041)
        for key in ("mismatch/mean_abs", "mismatch/k3"):
            assert metrics[seed, "fp32"][key] < metrics[seed, "model"][key], (seed, key, metrics)


def test_lm_head_dtype_values_come_from_the_table():
    with pytest.raises(ConfigError, match="lm_head_dtype"):
        LearnerConfig(lm_head_dtype="fp16")
    assert LearnerConfig().head_dtype is None and LearnerConfig(lm_head_dtype="fp32").head_dtype == torch.float32


def test_the_memory_plan_counts_the_fp32_readout():
    """What an fp32 head adds to the tensors autograd saves in the score forward (the fp32 norm of
    each step's state and the fp32 states the kernel keeps) is what the plan's activations add."""
    from rltt.model import LoopConfig, LoopedForCausalLM
    from rltt.planning.activations import activation_bytes
    from rltt.planning.shapes import ModelShape

    config = LoopConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_loops=3)
    model = LoopedForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 97, (4, 48))
    score_mask = torch.zeros(4, 48, dtype=torch.bool)
    score_mask[:, 12:] = True
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved(head_dtype) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen.setdefault(storage.data_ptr(), storage.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), score_mask=score_mask, use_cache=False,
                  head_dtype=head_dtype)
        return sum(seen.values())

    measured = saved(torch.float32) - saved(None)
    shape, n, scored = ModelShape.of(config), 4 * 48, int(score_mask.sum())
    planned = activation_bytes(shape, 2, n, scored, fp32_readout=True) - activation_bytes(shape, 2, n, scored)
    assert measured > 0 and abs(planned - measured) <= 0.05 * measured, (planned, measured)
    assert activation_bytes(shape, 4, n, scored, fp32_readout=True) == activation_bytes(shape, 4, n, scored)
