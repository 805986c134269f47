"""The engine's passes run in inference mode: what a pass makes is an inference tensor, the executor's state
and the fused q/k/v copies stay normal tensors (written in place outside a pass, at fixed addresses), and
the rollout is the one it was under ``no_grad``, bit for bit."""

import torch

from rltt.rollout import NativeEngine, SamplingParams
from rltt.rollout.executor import PassExecutor
from tests.rollout.helpers import fields_equal, prompts, rollout_fields, tiny_model

PARAMS = dict(max_new_tokens=6, temperature=1.0, exit_policy="sample", seed=3, ignore_eos=True)


def test_a_pass_makes_inference_tensors_and_keeps_the_state_normal():
    model = tiny_model()
    executor = PassExecutor(model, num_rows=2, max_len=8)
    h, gates, last = executor.run([0, 1], [0, 0], [2, 3], [1, 1])
    assert h.is_inference() and gates.is_inference()
    state = [executor.tokens, executor.carry, executor.gates, *executor.cache.keys, *executor.cache.values]
    assert not any(t.is_inference() for t in state)
    executor.write_tokens(torch.tensor([1]), torch.tensor([5]))  # in place, outside a pass: allowed
    assert int(executor.tokens[0, 1]) == 5
    assert executor.logits(h).shape == (h.shape[0], model.config.vocab_size)  # read outside a pass


def test_fused_copies_made_in_a_pass_are_refreshed_in_place_after_a_weight_update():
    model = tiny_model()
    engine = NativeEngine(model)
    engine.generate(prompts([3, 5]), SamplingParams(**PARAMS))
    fused = model.model.layers[0].self_attn.fused_qkv
    assert fused.weight is not None and not fused.weight.is_inference()
    address = fused.weight.data_ptr()
    with torch.no_grad():  # an optimizer step outside any pass
        model.model.layers[0].self_attn.k_proj.weight.add_(0.01)
    model.model.refresh_fused_weights()
    assert fused.weight.data_ptr() == address
    attn = model.model.layers[0].self_attn
    assert torch.equal(fused.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))


def test_the_rollout_is_the_one_made_under_no_grad(monkeypatch):
    """The same rollout with the pass run under ``no_grad``, as before: every field equal, bit for bit."""
    batch = prompts([3, 5, 4])
    for schedule in ("dense", "deferred"):
        params = SamplingParams(schedule=schedule, **PARAMS)
        now = NativeEngine(tiny_model()).generate(batch, params)
        with monkeypatch.context() as m:
            m.setattr(PassExecutor, "run", torch.no_grad()(PassExecutor.run.__wrapped__))
            before = NativeEngine(tiny_model()).generate(batch, params)
        assert fields_equal(rollout_fields(now), rollout_fields(before))
