"""A tiny looped policy, a synthetic learner batch (prompt + completion, right-padded), and the
launch of a DeepSpeed worker script in one or several processes."""

import subprocess
import sys
from pathlib import Path

import torch

from rltt.learner import LearnerBatch
from rltt.model import LoopConfig, LoopedForCausalLM


def tiny_policy(seed: int = 0, **overrides) -> LoopedForCausalLM:
    torch.manual_seed(seed)
    fields = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, num_loops=3)
    fields.update(overrides)
    model = LoopedForCausalLM(LoopConfig(**fields))
    model.model.exit_gate.weight.data.normal_(0, 0.5)
    return model


def synthetic_batch(B: int = 4, prompt: int = 3, seed: int = 0, vocab: int = 61, T: int = 3,
                    group_size: int = 2) -> LearnerBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 6, (B,), generator=g)
    S = prompt + int(lengths.max())
    ids = torch.randint(0, vocab, (B, S), generator=g)
    attn = torch.zeros(B, S, dtype=torch.long)
    target = torch.zeros(B, S, dtype=torch.bool)
    for b, n in enumerate(lengths.tolist()):
        attn[b, : prompt + n] = 1
        target[b, prompt: prompt + n] = True
    exits = torch.randint(1, T + 1, (B, S), generator=g)
    rewards = torch.randint(0, 2, (B,), generator=g).float()
    adv = (rewards - rewards.view(-1, group_size).mean(1).repeat_interleave(group_size))
    return LearnerBatch(input_ids=ids, attention_mask=attn, target_mask=target, exit_steps=exits,
                        advantages=adv + 0.1, temperature=1.0)


ROOT = Path(__file__).resolve().parents[2]


def run_worker(worker: Path, *args, processes: int = 1, master_port: int | None = None, timeout: int = 600) -> None:
    """``python WORKER ARGS`` from the repository root (``torch.distributed.run`` with ``processes``
    ranks on ``master_port`` when more than one); a failure shows the end of its stderr."""
    from tests.subprocess_env import worker_env

    launch = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
        str(master_port)]
    proc = subprocess.run([*launch, str(worker), *map(str, args)], env=worker_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
