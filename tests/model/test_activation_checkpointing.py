"""Activation checkpointing (``model.gradient_checkpointing_enable()``, the learner's
``learner.activation_checkpointing``): one non-reentrant checkpoint per (loop step, layer) call in
the training forwards, the same values and gradients, a fraction of the saved activations, and
nothing changed in eval, no-grad or rollout passes."""

import pytest
import torch

from rltt.model import LoopedForCausalLM
from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs

from .helpers import tiny_model
from .test_packing import grouped_batch

VARIANTS = [
    {},
    {"injection": "scalar", "carry_normed_state": False},
    {"norm_placement": "ouro", "num_key_value_heads": 4},
    {"lora_rank": 2, "lora_targets": ["q_proj", "down_proj"]},
]


def _model(checkpointing: bool, dtype=torch.float32, **variant) -> LoopedForCausalLM:
    torch.manual_seed(0)
    model = tiny_model(num_loops=4, num_hidden_layers=3, **variant).train()
    if variant.get("lora_rank"):
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.1)
    model = model.to(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def _loss_and_grads(model, pack: bool):
    ids, attention, score = grouped_batch(0, [5, 9, 3], group=3, max_completion=10)
    out = model(input_ids=ids, attention_mask=attention, score_mask=score, temperature=0.7, pack=pack)
    weights = torch.linspace(0.5, 1.5, out.token_logprobs.numel()).view_as(out.token_logprobs)
    # log-probs, entropies and the exit distribution: every parameter (the gate too) gets a gradient
    loss = (out.token_logprobs * weights).sum() + 0.3 * out.token_entropy.sum() + out.token_exit_probs[:2].sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class CountCalls:
    """A checkpoint function that counts its calls and runs torch's non-reentrant checkpoint."""

    def __init__(self):
        self.calls = 0

    def __call__(self, fn, *args):
        self.calls += 1
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def test_the_transformers_switch_turns_it_on_and_off():
    model = _model(False)
    assert model.supports_gradient_checkpointing and not model.is_gradient_checkpointing
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing and model.model.checkpointing()
    model.eval()
    assert not model.model.checkpointing()  # eval
    model.train()
    with torch.no_grad():
        assert not model.model.checkpointing()  # no gradients
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing and not model.model.checkpointing()


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_every_loop_step_layer_call_is_checkpointed_in_training_only(pack):
    model = _model(False)
    counter = CountCalls()
    model._set_gradient_checkpointing(True, counter)
    ids, attention, score = grouped_batch(0, [5, 9], group=2, max_completion=6)
    T, L = model.config.num_loops, model.config.num_hidden_layers
    model(input_ids=ids, attention_mask=attention, score_mask=score, pack=pack)
    assert counter.calls == T * L
    with torch.no_grad():
        model(input_ids=ids, attention_mask=attention, score_mask=score, pack=pack)
    model.eval()
    model(input_ids=ids, attention_mask=attention, score_mask=score, pack=pack)
    assert counter.calls == T * L  # neither under no_grad nor in eval
    model.train()
    model._set_gradient_checkpointing(True, counter, every_n_layers=2)
    model(input_ids=ids, attention_mask=attention, score_mask=score, pack=pack)
    assert counter.calls == T * L + T * len(range(0, L, 2))  # transformers' every_n_layers


def test_a_cache_is_not_written_under_checkpointing():
    """The recompute would write a KV cache a second time: training forwards asking for one get
    none (transformers' rule); a cache-writing forward of the model itself is not checkpointed."""
    model = _model(False)
    counter = CountCalls()
    model._set_gradient_checkpointing(True, counter)
    ids = torch.randint(1, 97, (2, 7))
    out = model(input_ids=ids, use_cache=True)
    assert out.past_key_values is None and counter.calls == model.config.num_loops * model.config.num_hidden_layers
    out.logits.sum().backward()
    counter.calls = 0
    from rltt.model.loop_cache import LoopCache, ensure_slots

    cache = ensure_slots(LoopCache(), model.config.num_loops * model.config.num_hidden_layers)
    model.model(ids, past_key_values=cache)
    assert counter.calls == 0 and cache.get_seq_length() == 7


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("variant", VARIANTS, ids=["pre", "scalar-injection", "ouro", "lora"])
def test_loss_and_every_gradient_are_bitwise_equal_in_fp32(variant, pack):
    loss, grads = _loss_and_grads(_model(False, **variant), pack)
    loss_ckpt, grads_ckpt = _loss_and_grads(_model(True, **variant), pack)
    assert torch.equal(loss_ckpt, loss)
    assert grads_ckpt.keys() == grads.keys() and len(grads) == len(list(_model(False, **variant).parameters()))
    for name in grads:
        assert torch.equal(grads_ckpt[name], grads[name]), name


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_bf16_is_bitwise_equal_too(pack):
    loss, grads = _loss_and_grads(_model(False, torch.bfloat16, norm_placement="ouro"), pack)
    loss_ckpt, grads_ckpt = _loss_and_grads(_model(True, torch.bfloat16, norm_placement="ouro"), pack)
    assert torch.equal(loss_ckpt, loss)
    for name in grads:
        assert torch.equal(grads_ckpt[name], grads[name]), name


def test_the_random_state_is_as_without_checkpointing():
    """The recompute runs under the forward's saved RNG state and restores the current one."""
    states = []
    for checkpointing in (False, True):
        model = _model(checkpointing)
        torch.manual_seed(7)
        _loss_and_grads(model, pack=False)
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], states[1])


def saved_bytes(model, ids, attention, score) -> int:
    """Bytes of the distinct storages autograd saves in the score forward (parameters excluded),
    seen by ``saved_tensors_hooks``: under checkpointing that is each checkpoint's inputs (which
    it saves through the same hooks) and what runs outside the checkpoints."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, attention_mask=attention, score_mask=score, use_cache=False)
    assert out.token_logprobs.requires_grad
    return sum(seen.values())


@pytest.mark.parametrize("placement", ["pre", "ouro"])
def test_checkpointing_saves_a_fraction_of_the_activations(placement):
    """L = 3, T = 4, d = 64, F = 96: without checkpointing each position saves every layer call's
    internals (T·L of them); with it, the T·L layer inputs and what runs outside the layers."""
    ids, attention, score = grouped_batch(0, [12, 20], group=4, max_completion=24)
    without = saved_bytes(_model(False, norm_placement=placement), ids, attention, score)
    with_ckpt = saved_bytes(_model(True, norm_placement=placement), ids, attention, score)
    assert with_ckpt < 0.25 * without, (with_ckpt, without)


def test_rollouts_and_replay_are_unchanged_on_a_checkpointing_model_in_training_mode():
    """The executor calls `LoopedModel.step` without checkpointing, so an engine sharing the
    learner's (training-mode, checkpointing) model samples and replays the same bits."""
    prompts = [[3, 5, 7], [11, 2], [4, 4, 9, 1]]
    params = SamplingParams(n=2, max_new_tokens=6, seed=3, schedule="deferred", exit_policy="sample")
    runs = []
    for checkpointing in (False, True):
        model = _model(checkpointing)
        batch = NativeEngine(model).generate(prompts, params)
        runs.append((batch, replay_logprobs(model, batch)))
    (a, ra), (b, rb) = runs
    for field in ("completion_ids", "logprobs", "exit_steps"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(ra.logprobs, rb.logprobs)
