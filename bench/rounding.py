"""What ``learner.rounding: stochastic`` costs: a bf16 learner's update on the quickstart model's shape, round
to nearest against stochastic rounding, interleaved in one process, process CPU time (one thread).

    python bench/rounding.py                    # the cached quickstart model (built on first use), 64 rows x 80
    python bench/rounding.py --updates 6 --rows 64 --tokens 80

Each arm builds a learner on its own copy of the model (learner.dtype bf16, micro-batch 32) and runs
``--updates`` updates on the same random RL-shaped batches (the quickstart's 8 prompts x 8 rows, prompt
32 + completion 48 tokens by default); the first update of each is a warm-up. Printed: seconds per update of
each arm (median), the ratio, and the rounding step alone (all trained tensors, nearest vs stochastic).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rltt.learner import AlgorithmConfig, Learner, LearnerBatch, LearnerConfig  # noqa: E402
from rltt.learner.rounding import ROUNDINGS  # noqa: E402
from rltt.orchestration.policy import load_policy, resolve_model_path  # noqa: E402


def batch(vocab: int, rows: int, prompt: int, completion: int, seed: int, loops: int) -> LearnerBatch:
    gen = torch.Generator().manual_seed(seed)
    S = prompt + completion
    ids = torch.randint(1, vocab, (rows, S), generator=gen)
    lengths = torch.randint(completion // 2, completion + 1, (rows,), generator=gen)
    attn = torch.zeros(rows, S, dtype=torch.long)
    target = torch.zeros(rows, S, dtype=torch.bool)
    for r, n in enumerate(lengths.tolist()):
        attn[r, : prompt + n] = 1
        target[r, prompt: prompt + n] = True
    adv = torch.randn(rows, generator=gen)
    return LearnerBatch(input_ids=ids, attention_mask=attn, target_mask=target,
                        exit_steps=torch.randint(1, loops + 1, (rows, S), generator=gen), advantages=adv,
                        temperature=1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--completion", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, _ = load_policy(resolve_model_path("quickstart"), "fp32", "cpu")
    cfg = model.config
    batches = [batch(cfg.vocab_size, args.rows, args.prompt, args.completion, s, cfg.num_loops)
               for s in range(args.updates)]
    learners = {r: Learner(copy.deepcopy(model), LearnerConfig(dtype="bf16", lr=1e-6, micro_batch_size=32, rounding=r),
                           AlgorithmConfig(track_kl=False), batch_size=args.rows, max_len=args.completion)
                for r in ROUNDINGS}
    seconds = {r: [] for r in learners}
    for b in batches:  # interleaved, the first update of each a warm-up
        for r, learner in learners.items():
            start = time.process_time()
            learner.update(b)
            seconds[r].append(time.process_time() - start)
    rounding = {}
    for r, learner in learners.items():  # the rounding step alone, every trained tensor
        backend = learner.backend
        start = time.process_time()
        for k in range(5):
            backend._round_masters_into_module(100 + k)
        rounding[r] = (time.process_time() - start) / 5
    update = {r: statistics.median(s[1:]) for r, s in seconds.items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"quickstart model ({params:,} parameters, bf16 learner, {args.rows} rows x {args.prompt}+{args.completion}"
          f" tokens, one thread, process CPU time, {args.updates - 1} timed updates each)")
    print("| rounding | s per update (median) | rounding step alone (s) |")
    print("|---|---:|---:|")
    for r in learners:
        print(f"| {r} | {update[r]:.3f} | {rounding[r]:.4f} |")
    print(f"stochastic / nearest, whole update: {update['stochastic'] / update['nearest']:.3f}x; the rounding step's "
          f"extra time is {(rounding['stochastic'] - rounding['nearest']) / update['nearest']:.2%} of an update")


if __name__ == "__main__":
    main()
