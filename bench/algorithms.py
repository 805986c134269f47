"""Loss × advantage estimator on the quickstart: held-out gain and step time per algorithm.

Runs ``rltt train recipes/quickstart.yaml`` once per arm and seed — the recipe as it is plus the
arm's ``algorithm.*`` overrides (docs/design.md §5.5–5.6) — one run after another (``--jobs`` to
run several at once; step times are then not comparable), and prints a Markdown table: the held-out
solve-rate gain (final − step 0, mean ± standard error over seeds), the batch solve rate, the median
step time and its ratio to the baseline arm (``ppo_clip`` + ``grpo``, measured in the same process),
the median KL to the reference and the clipped share. The arms:

- ``ppo_clip/grpo``: the recipe (the baseline)
- ``gspo``: ``algorithm.loss=gspo`` (sequence-ratio clip 3e-4 / 4e-4)
- ``cispo``: ``algorithm.loss=cispo`` (weight cap 4)
- ``rloo``: ``algorithm.advantage=rloo algorithm.advantage_scale=none`` (RLOO as published)
- ``reinforce_pp``: ``algorithm.advantage=reinforce_pp algorithm.advantage_scale=batch``

    python bench/algorithms.py [--seeds 2] [--steps 250] [--out runs/bench-algorithms] [--jobs 1]
                               [--model PATH] [--arms gspo,rloo]
    python bench/algorithms.py --smoke        # every arm, one seed, 2 steps at toy size

The full run (5 arms × 2 seeds × 250 steps, held-out 256 × 2 samples at steps 0 and 250) takes
hours on a shared 2-core machine; ``--smoke`` takes about a minute with a tiny model
(``tests/bench/test_algorithms.py``). Each run's directory (``OUT/<arm>-s<seed>``) keeps its
``metrics.jsonl`` and its command is logged in ``OUT/<arm>-s<seed>.log``; a rerun reuses finished
runs (``--fresh`` reruns them). Figures go into bench/RESULTS.md with the exact command.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # _rltt_runs, when loaded from a file path

from _rltt_runs import SMOKE_OVERRIDES, call_rltt, command, failure, mean_se, median, read_records, \
    train_argv  # noqa: E402

RECIPE = "recipes/quickstart.yaml"
BASELINE = "ppo_clip/grpo"
#: arm → the recipe overrides that make it
ARMS: dict[str, tuple[str, ...]] = {
    BASELINE: (),
    "gspo": ("algorithm.loss=gspo",),
    "cispo": ("algorithm.loss=cispo",),
    "rloo": ("algorithm.advantage=rloo", "algorithm.advantage_scale=none"),
    "reinforce_pp": ("algorithm.advantage=reinforce_pp", "algorithm.advantage_scale=batch"),
}
#: what ``--smoke`` shrinks (besides one seed and 2 steps)

@dataclass
class Run:
    """One arm at one seed: its command, directory and what its metrics say."""

    arm: str
    seed: int
    argv: list[str]
    run_dir: Path
    seconds: float = 0.0
    error: str = ""
    summary: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{slug(self.arm)}-s{self.seed}"

    @property
    def command(self) -> str:
        return command(self.argv)


def slug(arm: str) -> str:
    return arm.replace("/", "-")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=2, help="seeds per arm (the standard error needs >= 2)")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-algorithms")
    p.add_argument("--model", default=None, help="model.path of every run (default: the recipe's, the "
                                                  "quickstart model built on first use)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (step times compare only with 1)")
    p.add_argument("--fresh", action="store_true", help="rerun arms whose run already finished")
    p.add_argument("--smoke", action="store_true", help="every arm, 1 seed, 2 steps, toy evaluation")
    args = p.parse_args(argv)
    args.arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or BASELINE not in args.arms:
        p.error(f"--arms: unknown {unknown} or missing the baseline {BASELINE!r} (known: {', '.join(ARMS)})")
    if args.smoke:
        args.seeds, args.steps = 1, 2
    return args


def build_runs(args: argparse.Namespace) -> list[Run]:
    runs = []
    for arm in args.arms:
        for seed in range(args.seeds):
            run_dir = args.out / f"{slug(arm)}-s{seed}"
            overrides = [*ARMS[arm], f"seed={seed}", *([f"model.path={args.model}"] if args.model else []),
                         *(SMOKE_OVERRIDES if args.smoke else ())]
            runs.append(Run(arm, seed, train_argv(RECIPE, overrides, args.steps, run_dir), run_dir))
    return runs


def summarize(run_dir: Path, steps: int) -> dict:
    """What the table reads from one finished run's metrics.jsonl."""
    records = read_records(run_dir)
    solve = [(r["step"], r["eval/solve_rate"]) for r in records if "eval/solve_rate" in r]
    train = [r for r in records if r["step"] > 0]
    if not solve or solve[-1][0] != steps or len(solve) < 2:
        raise RuntimeError(f"{run_dir}: no held-out solve rate at steps 0 and {steps}")
    return {
        "solve_start": solve[0][1], "solve_end": solve[-1][1], "gain": solve[-1][1] - solve[0][1],
        "train_solve_rate": sum(r.get("solve_rate", 0.0) for r in train) / max(len(train), 1),
        "step_seconds": median([r["time/step"] for r in train if "time/step" in r]),
        "kl_median": median([r["kl/ref"] for r in train if "kl/ref" in r]),
        "clip_frac": median([r["policy/clip_frac"] for r in train if "policy/clip_frac" in r]),
        "steps": len(train),
    }


def finished(run: Run, steps: int) -> bool:
    try:
        summarize(run.run_dir, steps)
        return True
    except (RuntimeError, OSError, ValueError):
        return False


def execute(run: Run, args: argparse.Namespace) -> Run:
    """Run one arm as ``rltt train`` in a subprocess (the log next to its directory)."""
    if not args.fresh and finished(run, args.steps):
        print(f"  {run.name}: reused", file=sys.stderr)
    else:
        log = args.out / f"{run.name}.log"
        start = time.perf_counter()
        code = call_rltt(run.argv, log)
        run.seconds = time.perf_counter() - start
        if code:
            run.error = failure(log, code)
            print(f"  {run.name}: FAILED ({run.error})", file=sys.stderr)
            return run
        print(f"  {run.name}: {run.seconds:.0f}s", file=sys.stderr)
    run.summary = summarize(run.run_dir, args.steps)
    return run


def aggregate(summaries: list[dict]) -> dict:
    """Mean ± standard error over seeds (SE NaN with one seed)."""
    out = {"seeds": len(summaries)}
    for key in ("gain", "solve_end", "train_solve_rate", "step_seconds", "kl_median", "clip_frac"):
        out[key], out[key + "_se"] = mean_se([s[key] for s in summaries])
    return out


def _pts(x: float, se: float) -> str:
    if not math.isfinite(x):
        return "–"
    return f"{100 * x:+.1f}" + (f" ± {100 * se:.1f}" if math.isfinite(se) else "")


def format_table(results: dict[str, dict], steps: int) -> str:
    base = results.get(BASELINE, {}).get("step_seconds", float("nan"))
    lines = [f"| arm | overrides | seeds | held-out gain (pts, {steps} steps) | train solve rate | step time (s) | "
             f"× {BASELINE} | median kl/ref | median clip frac |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, r in results.items():
        if not r.get("seeds"):
            lines.append(f"| {arm} | {' '.join(ARMS[arm]) or '(recipe)'} | 0 | failed | | | | | |")
            continue
        ratio = r["step_seconds"] / base if math.isfinite(base) and base > 0 else float("nan")
        lines.append(f"| {arm} | {' '.join(f'`{o}`' for o in ARMS[arm]) or '(recipe)'} | {r['seeds']} | "
                     f"{_pts(r['gain'], r['gain_se'])} | {r['train_solve_rate']:.3f} | {r['step_seconds']:.2f} | "
                     f"{ratio:.2f} | {r['kl_median']:.2e} | {r['clip_frac']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = build_runs(args)
    print(f"{len(runs)} runs of `rltt train {RECIPE}` into {args.out}", file=sys.stderr)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        done = list(pool.map(lambda r: execute(r, args), runs))
    results = {arm: aggregate([r.summary for r in done if r.arm == arm and not r.error]) for arm in args.arms}
    table = format_table(results, args.steps)
    report = {"steps": args.steps, "seeds": args.seeds, "smoke": args.smoke, "results": results,
              "runs": [{"arm": r.arm, "seed": r.seed, "command": r.command, "run_dir": str(r.run_dir),
                        "seconds": r.seconds, "error": r.error, **r.summary} for r in done]}
    (args.out / "algorithms.json").write_text(json.dumps(report, indent=2))
    (args.out / "algorithms.md").write_text(table)
    print(table)
    return 1 if any(r.error for r in done) else 0


if __name__ == "__main__":
    sys.exit(main())
