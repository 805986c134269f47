"""A tiny looped policy with a locally trained tokenizer, saved as a checkpoint directory."""

from pathlib import Path

import torch

from rltt.data import synthetic
from rltt.data.tokenizer import train_tokenizer
from rltt.model import LoopConfig, LoopedForCausalLM


def tiny_checkpoint(path: Path, num_loops: int = 3, **sizes) -> Path:
    """A random LoopLM (d=32, one layer) with a char tokenizer trained on quickstart problems;
    ``sizes`` override config fields (e.g. ``hidden_size=128, head_dim=64`` for vLLM's kernels)."""
    texts = [r["question"] + "\n" + r["answer"] for r in synthetic.generate(200, "quickstart", seed=5)]
    tok = train_tokenizer(texts, vocab_size=128, kind="char")
    torch.manual_seed(0)
    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2) | sizes
    config = LoopConfig(vocab_size=len(tok), num_loops=num_loops, pad_token_id=tok.pad_token_id,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        exit_policy="threshold:0.5", **fields)
    model = LoopedForCausalLM(config)
    model.model.exit_gate.bias.data.fill_(-0.5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
