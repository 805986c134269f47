"""Host cost of the per-token row record (`rltt.rollout.rows.Row` + `rows_batch`) against the record it
replaced (`CompletedRow` + `completion_batch`, read from git at the commit before the row record),
on the same work: R rows of N sampled tokens appended one by one, T gates per token, then one batch.

    python bench/row_record.py [--rows 32] [--tokens 256] [--loops 4] [--base 41a5c84]

Prints the best of 7 runs of each, interleaved, and the ratio (one thread)."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _old_module(base: str):
    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{base}:rltt/rollout/completions.py"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_completions.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("old_completions", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_completions"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--loops", type=int, default=4)
    parser.add_argument("--base", default="41a5c84")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rltt.rollout.params import SamplingParams
    from rltt.rollout.rollout_batch import RolloutStats, Schedule
    from rltt.rollout.rows import Row, rows_batch

    old = _old_module(args.base)
    R, N, T = args.rows, args.tokens, args.loops
    gates = [torch.rand(T, N) for _ in range(R)]
    common = dict(schedule=Schedule("dense"), params=SamplingParams(), stats=RolloutStats(), num_loops=T,
                  dtype=torch.float32, pad_id=0)

    def fill(rows):
        for j in range(N):
            for row in rows:
                row.add(100 + j, 2, -1.25, -0.5, -1)

    def before():
        rows = [old.CompletedRow() for _ in range(R)]
        fill(rows)
        return old.completion_batch([[1, 2]], [0] * R, rows, gates=lambda r, k: gates[r], **common)

    def after():
        rows = [Row() for _ in range(R)]
        fill(rows)
        for row, g in zip(rows, gates):
            row.add_gates(g)
        return rows_batch([[1, 2]], [0] * R, rows, **common)

    best = {"before": float("inf"), "after": float("inf")}
    for _ in range(7):
        for name, f in (("before", before), ("after", after)):
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    tokens = R * N
    for name, t in best.items():
        print(f"{name}: {t * 1e3:.2f} ms for {tokens} tokens, {t / tokens * 1e6:.3f} us a token")
    print(f"after / before: {best['after'] / best['before']:.2f}x "
          f"(+{(best['after'] - best['before']) / tokens * 1e6:.3f} us a token)")


if __name__ == "__main__":
    main()
