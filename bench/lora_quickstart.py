"""LoRA RL against full fine-tuning on the quickstart, several seeds per arm: held-out gain, step
time, process peak memory, and the arms compared problem by problem with whole runs permuted.

Each (arm, seed) trains its steps without in-run evaluations into ``OUT/<arm>-s<seed>`` and keeps
its final checkpoint; ``rltt eval`` then scores it (``eval.json``), and the base model is scored
once per seed with the same seed (``OUT/base-s<seed>.eval.json``): an arm's gain on a seed is its
pass@1 less that seed's base. Runs already done (their ``eval.json`` is there) are kept, so an
interrupted sweep continues. ``--jobs 2`` trains two runs at a time (one thread each).

    python bench/lora_quickstart.py --out runs/lora-quickstart --seeds 0-4 --jobs 2
    python bench/lora_quickstart.py --out runs/lora-quickstart --seeds 0-4 --report   # the tables alone

Arms (`ARMS`): ``shared`` / ``perloop`` — recipes/quickstart-lora.yaml as written (lr 5e-4, 200
steps), with one adapter or one per loop step; ``shared250`` / ``perloop250`` — the same for the
quickstart's 250 steps; ``shared1e3`` / ``perloop1e3`` / ``perloop3e4`` — 250 steps at lr 1e-3 /
3e-4; ``full`` — recipes/quickstart.yaml (full fine-tuning, lr 1e-4, 250 steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._rltt_runs import ROOT, call_rltt, failure, mean_se, median, read_records  # noqa: E402

LORA, FULL = "recipes/quickstart-lora.yaml", "recipes/quickstart.yaml"
PER_LOOP = "learner.lora.per_loop=true"
QUICKSTART_STEPS = "train.steps=250"
#: arm -> (recipe, overrides, steps)
ARMS = {
    "shared": (LORA, [], 200),
    "perloop": (LORA, [PER_LOOP], 200),
    "shared250": (LORA, [QUICKSTART_STEPS], 250),
    "perloop250": (LORA, [PER_LOOP, QUICKSTART_STEPS], 250),
    "shared1e3": (LORA, ["learner.lr=1.0e-3", QUICKSTART_STEPS], 250),
    "perloop1e3": (LORA, [PER_LOOP, "learner.lr=1.0e-3", QUICKSTART_STEPS], 250),
    "perloop3e4": (LORA, [PER_LOOP, "learner.lr=3.0e-4", QUICKSTART_STEPS], 250),
    "full": (FULL, [], 250),
}


def seeds_of(text: str) -> list[int]:
    """``0-4`` or ``0,2,3``."""
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def train_and_eval(arm: str, seed: int, out: Path) -> str:
    recipe, overrides, steps = ARMS[arm]
    run = out / f"{arm}-s{seed}"
    if (run / "eval.json").exists():
        return f"{arm} seed {seed}: done before"
    run.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    argv = ["train", recipe, f"seed={seed}", *overrides, "train.eval_every=0", "checkpoint.every=0",
            "checkpoint.save_final=true", "logging.review_at_end=false", "logging.progress=false",
            f"logging.run_dir={run}"]
    code = call_rltt(argv, out / f"{arm}-s{seed}.train.log")
    if code:
        return f"{arm} seed {seed}: train " + failure(out / f"{arm}-s{seed}.train.log", code)
    (run / "train_wall_s").write_text(f"{time.perf_counter() - start:.1f}\n")
    final = run / "checkpoints" / f"step-{steps:07d}"
    code = call_rltt(["eval", recipe, f"seed={seed}", *overrides, "--model", str(final), "--out",
                      str(run / "eval.json")], out / f"{arm}-s{seed}.eval.log")
    return f"{arm} seed {seed}: " + ("ok" if not code else "eval " + failure(out / f"{arm}-s{seed}.eval.log", code))


def base_eval(seed: int, out: Path) -> str:
    path = out / f"base-s{seed}.eval.json"
    if path.exists():
        return f"base seed {seed}: done before"
    code = call_rltt(["eval", LORA, f"seed={seed}", "--out", str(path)], out / f"base-s{seed}.log")
    return f"base seed {seed}: " + ("ok" if not code else failure(out / f"base-s{seed}.log", code))


def pass1(path: Path) -> float:
    return json.loads(path.read_text())["summary"]["pass@1"]["mean"]


def arm_rows(arm: str, seeds: list[int], out: Path) -> dict | None:
    """An arm's figures over the seeds it has finished."""
    done = [s for s in seeds if (out / f"{arm}-s{s}" / "eval.json").exists() and (out / f"base-s{s}.eval.json").exists()]
    if not done:
        return None
    gains, steps, rollout, learner, peaks, kls, walls = [], [], [], [], [], [], []
    for s in done:
        run = out / f"{arm}-s{s}"
        gains.append(100 * (pass1(run / "eval.json") - pass1(out / f"base-s{s}.eval.json")))
        records = [r for r in read_records(run) if r.get("step", 0) > 0]
        steps += [r["time/step"] for r in records if "time/step" in r]
        rollout += [r["time/rollout"] for r in records if "time/rollout" in r]
        learner += [r["time/learner"] for r in records if "time/learner" in r]
        peaks.append(max(r.get("memory/peak_gb", 0.0) for r in records))
        kls.append(statistics.mean(r["kl/ref"] for r in records[-10:] if "kl/ref" in r))
        if (run / "train_wall_s").exists():
            walls.append(float((run / "train_wall_s").read_text()))
    mean, se = mean_se(gains)
    return {"arm": arm, "seeds": done, "gains": gains, "mean": mean, "se": se, "step": median(steps),
            "rollout": median(rollout), "learner": median(learner), "peak_gb": max(peaks),
            "kl": statistics.mean(kls), "wall": median(walls) if walls else float("nan")}


def compare(a: str, b: str, seeds: list[int], out: Path) -> dict | None:
    from rltt.evaluation.results import compare_object

    files = [[str(out / f"{arm}-s{s}" / "eval.json") for s in seeds if (out / f"{arm}-s{s}" / "eval.json").exists()]
             for arm in (a, b)]
    if min(len(f) for f in files) < 2:
        return None
    return compare_object(",".join(files[0]), ",".join(files[1]))


def report(arms: list[str], seeds: list[int], out: Path) -> None:
    rows = [r for r in (arm_rows(arm, seeds, out) for arm in arms) if r is not None]
    print("| arm | steps | seeds | gain per seed (points) | mean gain ± SE | kl/ref, last 10 steps | median step (rollout, "
          "learner) | median train wall | process peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_seed = " ".join(f"{g:+.1f}" for g in r["gains"])
        print(f"| {r['arm']} | {ARMS[r['arm']][2]} | {len(r['seeds'])} | {per_seed} | **{r['mean']:+.1f} ± {r['se']:.1f}** | {r['kl']:.3f} | "
              f"{r['step']:.2f} s ({r['rollout']:.2f}, {r['learner']:.2f}) | {r['wall']:.0f} s | {r['peak_gb']:.2f} GB |")
    print()
    print("| A − B, pass@1 (runs permuted) | runs | difference, 95 % interval | p |")
    print("|---|---|---|---|")
    names = [r["arm"] for r in rows]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            obj = compare(a, b, seeds, out)
            if obj is None:
                continue
            d = obj["difference"]["pass@1"]
            lo, hi = (f"{100 * x:+.1f}" if x is not None else "∓inf" for x in d["ci95"])
            print(f"| {a} − {b} | {obj['a']['runs']} vs {obj['b']['runs']} ({obj['test']}) | {100 * d['mean']:+.1f} "
                  f"[{lo}, {hi}] | {d['p_value']:.3f} (smallest possible {d['p_min']:.3f}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "lora-quickstart")
    parser.add_argument("--arms", default="shared,perloop,full", help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0-4", help="0-4 or 0,2,3")
    parser.add_argument("--jobs", type=int, default=2, help="runs trained at once")
    parser.add_argument("--report", action="store_true", help="print the tables of the runs already done")
    args = parser.parse_args()
    arms, seeds = args.arms.split(","), seeds_of(args.seeds)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown {unknown} (known: {', '.join(ARMS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        with ThreadPoolExecutor(args.jobs) as pool:
            jobs = [pool.submit(base_eval, s, args.out) for s in seeds]
            jobs += [pool.submit(train_and_eval, arm, s, args.out) for s in seeds for arm in arms]
            for job in jobs:
                print(job.result(), flush=True)
    report(arms, seeds, args.out)


if __name__ == "__main__":
    main()
