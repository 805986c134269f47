"""The activation estimate against a measurement on tiny models.

The measurement is the sum of the distinct tensors autograd saves in the learner's score forward,
taken with ``torch.autograd.graph.saved_tensors_hooks`` (each storage counted once, parameters
excluded) — the tensors the backward keeps alive, which is what `activation_bytes` estimates.
With activation checkpointing the peak comes in the backward, at the first recompute: there
`PeakSavedBytes` adds the recompute's live tensors (seen by a dispatch mode run as the
checkpoint's recompute context) to the forward's saved tensors still alive, after every op."""

import contextlib

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rltt.model import LoopConfig, LoopedForCausalLM
from rltt.planning.activations import activation_bytes, layer_bytes, logits_workspace_bytes, norm_bytes
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


class PeakSavedBytes:
    """Peak bytes of the activations autograd holds over a forward and its backward: the storages
    the forward saves (checkpoint inputs included) and those a checkpoint's recompute makes,
    counted while alive (weak references), sampled at the forward's end and after every
    recomputed op. Parameters are excluded."""

    def __init__(self, model: torch.nn.Module):
        self.params = {StorageWeakRef(p.untyped_storage()).cdata for p in model.parameters()}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = self.forward = 0

    def add(self, t) -> None:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            ref = StorageWeakRef(storage)
            held = self.live.get(ref.cdata)
            if ref.cdata not in self.params and (held is None or held[0].expired()):
                self.live[ref.cdata] = (ref, storage.nbytes())

    def sample(self) -> int:
        self.live = {cdata: held for cdata, held in self.live.items() if not held[0].expired()}
        total = sum(n for _, n in self.live.values())
        self.peak = max(self.peak, total)
        return total

    def context_fn(self):
        """The checkpoint's (forward, recompute) contexts: the recompute's tensors are tracked."""
        tracker = self

        class Recompute(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    tracker.add(t)
                tracker.sample()
                return out

        return contextlib.nullcontext(), Recompute()

    def run(self, model: torch.nn.Module, loss_fn, checkpointing: bool) -> "PeakSavedBytes":
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": self.context_fn})

        def pack(t):
            self.add(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn()
        self.forward = self.sample()
        loss.backward()
        return self


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


CKPT_CASES = [CASES[0], CASES[1], CASES[2]]


@pytest.mark.parametrize("gate_grad", [False, True], ids=["gate-detached", "gate-differentiated"])
@pytest.mark.parametrize("name,fields,dtype", CKPT_CASES, ids=[c[0] for c in CKPT_CASES])
def test_checkpointed_estimate_within_15_percent_of_the_peak(name, fields, dtype, gate_grad):
    """With learner.activation_checkpointing the estimate is the peak at the first recompute; the
    forward's part alone (the checkpoint inputs and what runs outside them) is within 2 %. With the
    exit gate differentiated (the mixture log-prob) its stacked states are released before the
    recompute too, which the estimate (of the detached default) does not credit."""
    config = LoopConfig(**{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_loops": 3, **fields})
    torch.manual_seed(0)
    model = LoopedForCausalLM(config).to(dtype).train()
    rows, length, prompt = 4, 48, 12
    input_ids = torch.randint(0, config.vocab_size, (rows, length))
    score_mask = torch.zeros(rows, length, dtype=torch.bool)
    score_mask[:, prompt:] = True

    def loss():
        out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), score_mask=score_mask,
                    use_cache=False)
        gate = out.token_exit_probs.sum() if gate_grad else 0.0  # the mixture log-prob differentiates the gate
        return out.token_logprobs.sum() + out.token_entropy.sum() + gate

    measured = PeakSavedBytes(model).run(model, loss, checkpointing=True)
    shape, b = ModelShape.of(config), 4 if dtype == torch.float32 else 2
    n, scored = rows * length, int(score_mask.sum())
    estimate = activation_bytes(shape, b, n, scored, checkpointing=True)
    gate_states = n * shape.loops * (b * shape.hidden + 4) if gate_grad else 0
    assert abs(estimate - gate_states - measured.peak) <= 0.15 * measured.peak, (estimate, measured.peak)
    assert estimate >= 0.9 * measured.peak  # an over- rather than an under-estimate
    # the forward's part: what the recompute term adds on top of it is the rest
    recompute = max(0, n * layer_bytes(shape, b) - scored * (shape.loops * b * shape.hidden + 16 * shape.loops + 16)
                    - n * norm_bytes(shape.hidden, 1, b) * shape.final_norm)
    assert abs(estimate - recompute - measured.forward) <= 0.02 * measured.forward
    # checkpointing keeps a fraction of the full forward's activations
    assert measured.peak < 0.4 * activation_bytes(shape, b, n, scored)


def test_checkpointing_keeps_one_hidden_state_per_loop_layer_plus_one_layer():
    shape = model_shape(OURO_1_4B)
    n, scored = 8 * 1024, 8 * 512
    full = activation_bytes(shape, 2, n, scored)
    ckpt = activation_bytes(shape, 2, n, scored, checkpointing=True)
    layers_saved = shape.loops * shape.layers * n * layer_bytes(shape, 2)
    boundaries = shape.loops * shape.layers * n * 2 * shape.hidden
    per_scored = shape.loops * 2 * shape.hidden + 16 * shape.loops + 16
    released = scored * per_scored + n * norm_bytes(shape.hidden, 1, 2)  # before the first recompute
    assert full - ckpt == layers_saved - boundaries - (n * layer_bytes(shape, 2) - released)
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


def test_a_truncated_16_bit_rollout_adds_the_chunked_kernels_rounded_logits():
    """The chunked kernel decides a 16-bit rollout's kept set on the chunk's logits cast to 16 bits
    and back to fp32 (both alive at the cast); the Triton kernel rounds in registers."""
    from rltt.kernels._common import default_chunk_size

    shape = model_shape(OURO_1_4B)
    rows = shape.loops * 4096
    chunk = default_chunk_size(rows, shape.vocab)
    plain = logits_workspace_bytes(shape, 4, 4, positions=8192, scored=4096, impl="chunked")
    rounded = logits_workspace_bytes(shape, 4, 4, positions=8192, scored=4096, impl="chunked", kept_bytes=2)
    assert rounded - plain == rows * chunk * (2 + 4)
    assert logits_workspace_bytes(shape, 4, 4, positions=8192, scored=4096, impl="triton", kept_bytes=2) == \
        logits_workspace_bytes(shape, 4, 4, positions=8192, scored=4096, impl="triton")
