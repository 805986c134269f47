"""`rltt generate`: sample from a looped model (a checkpoint, or a freshly built tiny one)."""

from __future__ import annotations

import argparse

import torch

from rltt.errors import RlttError


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate from a looped model and show each token's exit step")
    p.add_argument("--model", default=None, help="checkpoint directory (rltt, Ouro or dense HF); default: a tiny random LoopLM")
    p.add_argument("--prompt", default="Question: Tom has 3 apples", help="prompt text (needs a tokenizer) ")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--exit-policy", default=None, help="final | fixed:k | threshold:q | sample")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def _tiny_model():
    from rltt.model import LoopConfig, LoopedForCausalLM

    config = LoopConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=2, head_dim=64, num_loops=4, exit_policy="threshold:0.5")
    return LoopedForCausalLM(config).eval(), None


def run(args: argparse.Namespace) -> int:
    from rltt.model import load_looped

    torch.manual_seed(args.seed)
    if args.model is None:
        model, tokenizer = _tiny_model()
        ids = torch.tensor([list(args.prompt.encode("utf-8"))])  # bytes as token ids
        decode = lambda toks: bytes(t % 256 for t in toks).decode("utf-8", errors="replace")  # noqa: E731
    else:
        from transformers import AutoTokenizer

        model = load_looped(args.model).eval()
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise RlttError(f"generate: no tokenizer in {args.model} ({exc.__class__.__name__})") from None
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        decode = tokenizer.decode
    policy = model.exit_policy(args.exit_policy)
    steps, tokens = [], []
    with torch.no_grad():
        out = model(ids, use_cache=True, exit_policy=policy, logits_to_keep=1)
        for _ in range(args.max_new_tokens):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            steps.append(int(out.exit_steps[0, -1]))
            out = model(token, past_key_values=out.past_key_values, use_cache=True, exit_policy=policy)
    print(f"model: T={model.config.num_loops} loops × L={model.config.num_hidden_layers} layers, exit policy {policy}")
    print(f"completion: {decode(tokens)!r}")
    print(f"exit steps: {steps}  (mean {sum(steps) / len(steps):.2f} of {model.config.num_loops})")
    return 0
