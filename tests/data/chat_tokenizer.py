"""A tiny byte-level tokenizer with ``<think>``/``</think>`` special tokens and a Jinja chat template,
built in the test (nothing downloaded), and a tiny looped checkpoint that uses it."""

from pathlib import Path

import torch

from rltt.data.tokenizer import train_tokenizer

THINK_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML, as Qwen-style thinking models write it; the generation prompt opens the assistant turn
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\n' }}{% endif %}{% endif %}"
)


def chat_tokenizer(with_template: bool = True):
    """Byte-level BPE with no merges (256 byte tokens + rltt's 4 specials) plus the chat/think tokens."""
    tok = train_tokenizer(["x"], vocab_size=260, kind="bpe")
    tok.add_special_tokens({"additional_special_tokens": THINK_TOKENS})
    if with_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def chat_checkpoint(path: Path, num_loops: int = 2) -> Path:
    """A tiny random LoopLM saved with `chat_tokenizer` (chat template included)."""
    from rltt.model import LoopConfig, LoopedForCausalLM

    tok = chat_tokenizer()
    torch.manual_seed(0)
    config = LoopConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_loops=num_loops, max_position_embeddings=512,
                        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, exit_policy="threshold:0.5")
    model = LoopedForCausalLM(config)
    model.model.exit_gate.bias.data.fill_(-0.5)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
