"""Tiny looped models and prompts for rollout tests."""

import torch

from rltt.model import LoopConfig, LoopedForCausalLM

VOCAB = 61


def tiny_model(num_loops: int = 4, gate_bias: float = -0.5, dtype=torch.float32, **overrides) -> LoopedForCausalLM:
    """A random tiny model whose gate gives mixed exits (different t* across tokens)."""
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_loops=num_loops, max_position_embeddings=64)
    fields.update(overrides)
    torch.manual_seed(1234)
    model = LoopedForCausalLM(LoopConfig(**fields)).eval()
    with torch.no_grad():
        model.model.exit_gate.weight.normal_(0, 1.0)
        model.model.exit_gate.bias.fill_(gate_bias)
    return model.to(dtype)


def prompts(sizes, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in sizes]
