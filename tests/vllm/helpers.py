"""Shared set-up of the vLLM tests: tiny looped models vLLM's CPU attention accepts (head_dim 64)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rltt.model import LoopConfig, LoopedForCausalLM

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (pip install 'rltt[vllm]' / "
                                                      "bash scripts/setup_env.sh all)")
# small engines: 1 GiB of CPU KV cache, short contexts
ENGINE_OPTIONS = dict(kv_cache_gb=1, max_model_len=128, max_num_seqs=32)
PROMPTS = [[1, 5, 9, 3], [7, 8], [2, 3, 4, 5, 6, 7], [11], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def looped_model(num_loops: int = 2, seed: int = 0, **overrides) -> LoopedForCausalLM:
    fields = dict(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_loops=num_loops,
                  max_position_embeddings=128)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = LoopedForCausalLM(LoopConfig(**fields)).eval()
    # a non-trivial gate so exit distributions are far from uniform
    model.model.exit_gate.weight.data.normal_(0, 0.5)
    return model


def perturbed(model: LoopedForCausalLM, seed: int = 1, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A state dict near ``model``'s (a learner step's worth of change, but enough to flip greedy tokens)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
            for k, v in model.state_dict().items()}
