"""The activation estimate against a measurement on tiny models.

The measurement is the sum of the distinct tensors autograd saves in the learner's score forward,
taken with ``torch.autograd.graph.saved_tensors_hooks`` (each storage counted once, parameters
excluded) — the tensors the backward keeps alive, which is what `activation_bytes` estimates."""

import pytest
import torch

from rltt.model import LoopConfig, LoopedForCausalLM
from rltt.planning.activations import activation_bytes, layer_bytes, logits_workspace_bytes
from rltt.planning.shapes import ModelShape, model_shape
from tests.planning.helpers import OURO_1_4B


def saved_tensor_bytes(model: torch.nn.Module, input_ids: torch.Tensor, score_mask: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), score_mask=score_mask,
                    use_cache=False)
    assert out.token_logprobs.requires_grad
    return sum(seen.values())


CASES = [
    ("pre", dict(), torch.float32),
    ("ouro", dict(norm_placement="ouro", num_hidden_layers=3, num_loops=4), torch.bfloat16),
    ("qwen3-like", dict(qk_norm=True, num_key_value_heads=2, injection="scalar"), torch.float32),
    ("post", dict(norm_placement="post", tie_word_embeddings=True), torch.bfloat16),
]


@pytest.mark.parametrize("name,fields,dtype", CASES, ids=[c[0] for c in CASES])
def test_activation_estimate_within_15_percent_of_the_saved_tensors(name, fields, dtype):
    config = LoopConfig(**{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_loops": 3, **fields})
    model = LoopedForCausalLM(config).to(dtype)
    rows, length, prompt = 4, 48, 12
    input_ids = torch.randint(0, config.vocab_size, (rows, length))
    score_mask = torch.zeros(rows, length, dtype=torch.bool)
    score_mask[:, prompt:] = True
    measured = saved_tensor_bytes(model, input_ids, score_mask)
    b = 4 if dtype == torch.float32 else 2
    estimate = activation_bytes(ModelShape.of(config), b, rows * length, int(score_mask.sum()))
    assert abs(estimate - measured) <= 0.15 * measured, (estimate, measured)


def test_checkpointing_keeps_one_hidden_state_per_loop_layer_plus_one_layer():
    shape = model_shape(OURO_1_4B)
    n, scored = 8 * 1024, 8 * 512
    full = activation_bytes(shape, 2, n, scored)
    ckpt = activation_bytes(shape, 2, n, scored, checkpointing=True)
    layers_saved = shape.loops * shape.layers * n * layer_bytes(shape, 2)
    boundaries = shape.loops * shape.layers * n * 2 * shape.hidden
    assert full - ckpt == layers_saved - boundaries - n * layer_bytes(shape, 2)
    assert ckpt < full / 10


def test_ouro_layer_bytes_by_hand():
    shape = model_shape(OURO_1_4B)
    d, F, b = 2048, 5632, 2
    norm = 4 * d + b * d + 4
    attention = b * d + b * 4 * d + 4 * 16
    mlp = b * d + 4 * b * F
    assert layer_bytes(shape, b) == 4 * norm + attention + mlp


def test_logits_workspace_holds_the_head_gradient_and_not_the_logits():
    shape = model_shape(OURO_1_4B)
    work = logits_workspace_bytes(shape, 2, 2, positions=8192, scored=4096, impl="triton")
    head_grad = shape.vocab * shape.hidden * 2
    all_logits = shape.loops * 4096 * shape.vocab * 4
    assert head_grad < work < all_logits / 4
