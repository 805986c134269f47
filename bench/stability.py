"""Pretraining stability at tiny scale: exit-gate collapse and gradient flow by norm placement.

Measures two failure modes of looped-model pretraining (docs/design.md §5, §6) with short CPU
pretraining runs on the synthetic task; what was and was not reproduced at this scale is in
bench/RESULTS.md ("Pretraining stability"):

1. **Gate collapse**: the exit distribution over steps, and the collapse alarm, without LR
   warmup at β ∈ {0.05, 0.10, 0.15} and with a warmup control at β = 0.05 (the failure mode
   looked for: without warmup and with a small β the gate collapses onto loop 1). A higher LR
   than the quickstart's provokes the collapse quickly.
2. **Norm placement**: per-layer grad norms of the shared block under pre-, post- and
   sandwich-norm (the failure mode: vanishing gradients in the early layers).

    python bench/stability.py [--out runs/bench-stability] [--steps-collapse 80] [--steps-norm 40]

Prints Markdown tables (exit distribution over steps; per-layer grad norms) and writes
``OUT/stability.json``. Total runtime is a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltt.lm_training.pretraining import pretrain  # noqa: E402
from rltt.lm_training.stage_recipe import load_stage_recipe  # noqa: E402
from rltt.telemetry import read_metrics  # noqa: E402

T = 4


def base_data(out: Path, name: str, steps: int, layers: int = 2) -> dict:
    return {
        "data": {"source": "synthetic:quickstart", "block_size": 64, "held_out_docs": 32},
        "tokenizer": {"kind": "bpe", "vocab_size": 512, "train_docs": 1000},
        "model": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
                             "num_attention_heads": 1, "num_loops": T, "max_position_embeddings": 128}},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "grad_clip": 1.0, "min_lr_ratio": 1.0},
        "objective": {"beta": 0.15},
        "train": {"steps": steps, "batch_size": 8, "threads": 1},
        "logging": {"run_dir": str(out / name), "every": 1, "progress": False},
        "checkpoint": {"every": steps},
        "eval": {"every": steps, "loss_batches": 1, "solve_problems": 0},
        "alarm": {"p1_threshold": 0.9, "patience": 3},
    }


def run_arm(out: Path, name: str, data: dict, overrides: list[str]) -> list[dict]:
    shutil.rmtree(out / name, ignore_errors=True)
    start = time.perf_counter()
    result = pretrain(load_stage_recipe("pretrain", data=data, overrides=overrides))
    records = [r for r in read_metrics(out / name) if "exit/p_1" in r]
    print(f"  {name}: {time.perf_counter() - start:.0f}s, alarms at {[a['step'] for a in result.alarms]}",
          file=sys.stderr)
    return records


def collapse_experiment(out: Path, steps: int, lr: float) -> dict:
    arms = {
        "no-warmup beta=0.05": ["objective.beta=0.05"],
        "no-warmup beta=0.10": ["objective.beta=0.10"],
        "no-warmup beta=0.15": ["objective.beta=0.15"],
        "warmup beta=0.05": ["objective.beta=0.05", f"optim.warmup_steps={steps // 4}"],
    }
    results = {}
    for name, overrides in arms.items():
        slug = "collapse-" + name.replace(" ", "-").replace("=", "")
        records = run_arm(out, slug, base_data(out, slug, steps), [f"optim.lr={lr}", *overrides])
        results[name] = {
            "steps": [r["step"] for r in records],
            "p": [[r[f"exit/p_{t}"] for t in range(1, T + 1)] for r in records],
            "loss": [r["lm/loss"] for r in records],
            "alarms": [json.loads(line)["step"] for line in
                       (out / slug / "alarms.jsonl").read_text().splitlines()] if (out / slug / "alarms.jsonl").exists() else [],
        }
    return results


def norm_experiment(out: Path, steps: int, layers: int) -> dict:
    results = {}
    for placement in ("pre", "post", "sandwich"):
        slug = f"norm-{placement}"
        records = run_arm(out, slug, base_data(out, slug, steps, layers),
                          [f"model.config.norm_placement={placement}", "optim.warmup_steps=5"])
        per_layer = [[r[f"grad_norm/layer/{i}"] for r in records] for i in range(layers)]
        results[placement] = {
            "mean_layer_grad": [sum(v) / len(v) for v in per_layer],
            "final_loss": records[-1]["lm/loss"],
        }
    return results


def collapse_table(results: dict, every: int) -> str:
    lines = ["| arm | step | p_1 | p_2 | p_3 | p_4 | E[t] | lm/loss |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for i, step in enumerate(r["steps"]):
            if step % every and step != r["steps"][-1] and step != 1:
                continue
            p = r["p"][i]
            et = sum((t + 1) * v for t, v in enumerate(p))
            lines.append(f"| {name} | {step} | " + " | ".join(f"{v:.2f}" for v in p) + f" | {et:.2f} | {r['loss'][i]:.3f} |")
    alarms = "; ".join(f"{n}: {r['alarms'] or 'none'}" for n, r in results.items())
    return "\n".join(lines) + f"\n\nCollapse alarms (step fired): {alarms}\n"


def norm_table(results: dict) -> str:
    layers = len(next(iter(results.values()))["mean_layer_grad"])
    head = "| placement | " + " | ".join(f"layer {i}" for i in range(layers)) + " | first/last | final lm/loss |"
    lines = [head, "|" + "---|" * (layers + 3)]
    for name, r in results.items():
        g = r["mean_layer_grad"]
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for v in g) + f" | {g[0] / g[-1]:.2f} | {r['final_loss']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench-stability")
    parser.add_argument("--steps-collapse", type=int, default=80)
    parser.add_argument("--lr-collapse", type=float, default=1e-2)
    parser.add_argument("--steps-norm", type=int, default=40)
    parser.add_argument("--layers-norm", type=int, default=6)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    collapse = collapse_experiment(out, args.steps_collapse, args.lr_collapse)
    norms = norm_experiment(out, args.steps_norm, args.layers_norm)
    elapsed = time.perf_counter() - start
    (out / "stability.json").write_text(json.dumps({"collapse": collapse, "norm": norms, "seconds": elapsed,
                                                    "args": vars(args)}, indent=1))
    print(f"### Exit distribution over steps (no warmup unless named; lr {args.lr_collapse}, T = {T})\n")
    print(collapse_table(collapse, max(1, args.steps_collapse // 4)))
    print(f"### Mean per-layer grad norm ({args.layers_norm} layers, {args.steps_norm} steps)\n")
    print(norm_table(norms))
    print(f"total {elapsed:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
