"""A price on compute on the quickstart: held-out solve rate against the loops the policy runs.

For each price λ (``algorithm.compute_cost``, docs/design.md §5.11) and seed it runs
``rltt train recipes/quickstart.yaml rollout.exit_policy=sample algorithm.exit_action=true
algorithm.compute_cost=λ`` (the exit step part of the action, §5.12, so the gate gets a gradient;
``--no-exit-action`` leaves it out; the deferred schedule of the recipe, so a lower exit step is
fewer serial passes), then ``rltt eval`` of the run's
final checkpoint at the same exit policy (K samples per held-out problem, ``--out RUN/eval.json``), and
prints one Markdown row per λ:

- held-out pass@1, mean ± SE over seeds and problems (the two-level bootstrap of ``rltt eval --pool``),
  and its difference to λ = 0 with SE and p-value (``rltt eval --compare``: a permutation of runs with
  ≥ 2 seeds a side);
- the held-out mean recorded exit step and serial passes per token, before (the run's step-0
  evaluation, ``eval/compute/*``) and after (the final checkpoint's ``rltt eval``), mean over seeds;
- the training rollouts' tokens/s (``throughput/tokens_per_s``) and passes per token
  (``compute/passes_per_token``): medians of the first and of the last tenth of the steps;
- the penalty paid late in training (``reward/compute``);
- the goal: a mean exit step ≥ 25 % below λ = 0's with pass@1 no more than 2 SE (of the difference)
  below λ = 0's;

and then a speed check in this process: each price's first-seed final checkpoint rolled out on the
same held-out prompts (the recipe's sampling, deferred schedule, one thread, the prices interleaved,
the fastest of ``--speed-repeats``): completion tokens per CPU second, serial passes and passes per
token, and the ratio to λ = 0 — the same rollout code on the same prompts, so a lower exit step
shows as speed without the noise of other jobs that the training runs' own tokens/s carry.

    python bench/compute.py [--lambdas 0,0.1,0.3,1] [--seeds 5] [--steps 150] [--eval-samples 4]
                            [--out runs/bench-compute] [--jobs 1] [--model PATH] [--fresh] [--no-exit-action]
                            [--speed-repeats 3] [--speed-prompts 32] [--compute-price reward|advantage]
    python bench/compute.py --smoke        # λ = 0 and 0.5, one seed, 2 steps at toy size

The full run (4 λ × 5 seeds × 150 steps, then 256 held-out problems × 4 samples per run) takes many
hours on a shared 2-core machine; ``--smoke`` takes about a minute with a tiny model
(``tests/bench/test_compute.py``). It is resumable: each run's directory (``OUT/lam<λ>-s<seed>``) keeps
its ``metrics.jsonl``, final checkpoint and ``eval.json``, and its commands are logged in
``OUT/lam<λ>-s<seed>.log``; a rerun reuses what finished (a trained run without its evaluation is only
evaluated; ``--fresh`` reruns everything). Throughput compares across λ only with ``--jobs 1`` on a
machine with nothing else running. Figures go into bench/RESULTS.md with the exact command.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
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

from rltt.learner.settings import AlgorithmConfig  # noqa: E402
from rltt.objectives.advantages import COMPUTE_PRICES  # noqa: E402

#: where the price enters when --compute-price is not given: the recipe default
DEFAULT_PRICE = AlgorithmConfig.compute_price

RECIPE = "recipes/quickstart.yaml"
EXIT_POLICY = "sample"
LAMBDAS = (0.0, 0.1, 0.3, 1.0)
SMOKE_LAMBDAS = (0.0, 0.5)
#: the goal: the mean exit step this much below λ = 0's ...
EXIT_FALL_GOAL = 0.25
#: ... with pass@1 at most this many standard errors (of the difference) below λ = 0's
SOLVE_SE_GOAL = 2.0
BOOTSTRAP = 2000
#: a checkpoint every this many steps, so a killed run resumes (``rltt train --resume``) instead of restarting
CHECKPOINT_EVERY = 25
EVAL_FILE = "eval.json"


@dataclass
class Run:
    """One price at one seed: its commands, directory and what its metrics and evaluation say."""

    lam: float
    seed: int
    train_argv: list[str]
    eval_argv: list[str]
    run_dir: Path
    seconds: float = 0.0
    error: str = ""
    summary: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"lam{self.lam:g}-s{self.seed}"

    @property
    def eval_file(self) -> Path:
        return self.run_dir / EVAL_FILE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lambdas", default=",".join(f"{x:g}" for x in LAMBDAS),
                   help="comma-separated prices algorithm.compute_cost; 0 (the baseline) is always run")
    p.add_argument("--seeds", type=int, default=5, help="seeds per price (the standard errors need >= 2)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-samples", type=int, default=4, help="samples per held-out problem in rltt eval")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-compute")
    p.add_argument("--model", default=None, help="model.path of every run (default: the recipe's, the "
                                                  "quickstart model built on first use)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (throughput compares only with 1)")
    p.add_argument("--fresh", action="store_true", help="rerun and re-evaluate runs that already finished")
    p.add_argument("--smoke", action="store_true", help="λ = 0 and 0.5, 1 seed, 2 steps, toy evaluation")
    p.add_argument("--speed-repeats", type=int, default=3,
                   help="rollouts per price in the same-process speed check (fastest counts; 0: skip it)")
    p.add_argument("--speed-prompts", type=int, default=32, help="held-out prompts per speed-check rollout")
    p.add_argument("--compute-price", choices=tuple(COMPUTE_PRICES), default=DEFAULT_PRICE,
                   help="algorithm.compute_price of the priced runs (λ = 0 runs are the same run either way)")
    p.add_argument("--no-exit-action", dest="exit_action", action="store_false",
                   help="leave algorithm.exit_action off (the gate then gets no gradient from the exit log-prob)")
    args = p.parse_args(argv)
    try:
        lambdas = sorted({float(x) for x in args.lambdas.split(",") if x.strip()} | {0.0})
    except ValueError:
        p.error(f"--lambdas: numbers separated by commas, got {args.lambdas!r}")
    if any(not math.isfinite(x) or x < 0 for x in lambdas):
        p.error(f"--lambdas: every price must be >= 0, got {args.lambdas!r}")
    args.lambdas = tuple(lambdas)
    if args.smoke:
        args.lambdas, args.seeds, args.steps, args.eval_samples = SMOKE_LAMBDAS, 1, 2, 1
        args.speed_prompts, args.speed_repeats = 2, min(args.speed_repeats, 1)
    if args.seeds < 1 or args.steps < 1 or args.eval_samples < 1 or args.speed_prompts < 1:
        p.error("--seeds, --steps, --eval-samples and --speed-prompts must be >= 1")
    if args.speed_repeats < 0:
        p.error("--speed-repeats must be >= 0")
    return args


def build_runs(args: argparse.Namespace) -> list[Run]:
    runs = []
    for lam in args.lambdas:
        for seed in range(args.seeds):
            run_dir = args.out / f"lam{lam:g}-s{seed}"
            recipe = [f"rollout.exit_policy={EXIT_POLICY}", f"algorithm.exit_action={str(args.exit_action).lower()}",
                      f"algorithm.compute_cost={lam:g}", f"seed={seed}"]
            if args.compute_price != DEFAULT_PRICE and lam > 0:
                recipe.insert(3, f"algorithm.compute_price={args.compute_price}")
            if args.model:
                recipe.append(f"model.path={args.model}")
            if args.smoke:
                recipe += SMOKE_OVERRIDES
            train = train_argv(RECIPE, recipe, args.steps, run_dir, checkpoint_every=CHECKPOINT_EVERY)
            final = run_dir / "checkpoints" / f"step-{args.steps:07d}"
            evaluate = ["eval", RECIPE, *recipe, "--model", str(final), "--samples", str(args.eval_samples),
                        "--out", str(run_dir / EVAL_FILE), "--bootstrap", "100"]
            runs.append(Run(lam, seed, train, evaluate, run_dir))
    return runs


def train_summary(run_dir: Path, steps: int) -> dict:
    """What the table reads from one finished training run's metrics.jsonl."""
    from rltt.telemetry import schema as m

    records = read_records(run_dir)
    evals = {r["step"]: r for r in records if m.EVAL_SOLVE_RATE in r}
    train = [r for r in records if r["step"] > 0 and m.REWARD_MEAN in r]
    if 0 not in evals or steps not in evals or len(train) < steps:
        raise RuntimeError(f"{run_dir}: not finished (held-out evaluations at steps 0 and {steps}, {steps} steps)")
    tenth = max(1, len(train) // 10)
    first, last = train[:tenth], train[-tenth:]

    def med(rows: list[dict], key: str) -> float:
        return median([r.get(key, float("nan")) for r in rows])

    start = evals[0]
    return {
        "solve_start": start[m.EVAL_SOLVE_RATE],
        "exit_start": start.get(m.EVAL_COMPUTE_MEAN_EXIT, float("nan")),
        "ppt_start": start.get(m.EVAL_COMPUTE_PASSES_PER_TOKEN, float("nan")),
        "tok_s_first": med(first, m.THROUGHPUT_TOKENS_PER_S), "tok_s_last": med(last, m.THROUGHPUT_TOKENS_PER_S),
        "train_ppt_first": med(first, m.COMPUTE_PASSES_PER_TOKEN),
        "train_ppt_last": med(last, m.COMPUTE_PASSES_PER_TOKEN),
        "train_exit_first": med(first, m.COMPUTE_MEAN_EXIT), "train_exit_last": med(last, m.COMPUTE_MEAN_EXIT),
        "exit_entropy_last": med(last, m.COMPUTE_EXIT_ENTROPY),
        "penalty_last": med(last, m.REWARD_COMPUTE) if any(m.REWARD_COMPUTE in r for r in last) else 0.0,
        "train_solve_last": med(last, m.SOLVE_RATE),
        "steps": len(train),
    }


def eval_summary(path: Path) -> dict:
    obj = json.loads(path.read_text())
    passes = obj.get("passes_per_token")
    return {"solve_end": obj["summary"]["pass@1"]["mean"], "exit_end": obj["mean_exit_step"],
            "ppt_end": float("nan") if passes is None else passes}


def summarize(run: Run, steps: int) -> dict:
    return {**train_summary(run.run_dir, steps), **eval_summary(run.eval_file)}


def trained(run: Run, steps: int) -> bool:
    try:
        train_summary(run.run_dir, steps)
        return True
    except (RuntimeError, OSError, ValueError, KeyError):
        return False


def evaluated(run: Run) -> bool:
    try:
        eval_summary(run.eval_file)
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def resumable(run: Run) -> bool:
    """The run stopped after a checkpoint: ``rltt train --resume`` continues it."""
    from rltt.orchestration.saver import STATE_FILE
    from rltt.runtime.checkpoint import list_checkpoints

    return (run.run_dir / "metrics.jsonl").is_file() and bool(list_checkpoints(run.run_dir, STATE_FILE))


def execute(run: Run, args: argparse.Namespace) -> Run:
    """Train (unless finished; resumed from its last checkpoint when it stopped) and evaluate (unless
    done) one run in subprocesses, logged beside it."""
    log = args.out / f"{run.name}.log"
    start = time.perf_counter()
    steps = []
    if args.fresh or not trained(run, args.steps):
        if not args.fresh and resumable(run):
            steps.append(("train", [*run.train_argv, "--resume"]))
        else:
            if run.run_dir.exists():  # a fresh start, or a run stopped before its first checkpoint
                shutil.rmtree(run.run_dir)
            log.write_text("")
            steps.append(("train", run.train_argv))
    if args.fresh or not evaluated(run):
        steps.append(("eval", run.eval_argv))
    for what, argv in steps:
        code = call_rltt(argv, log, append=True)
        if code:
            run.error = f"{what}: {failure(log, code)}"
            print(f"  {run.name}: FAILED ({run.error})", file=sys.stderr)
            return run
    run.seconds = time.perf_counter() - start
    print(f"  {run.name}: " + (f"{run.seconds:.0f}s" if steps else "reused"), file=sys.stderr)
    run.summary = summarize(run, args.steps)
    return run


KEYS = ("solve_start", "solve_end", "exit_start", "exit_end", "ppt_start", "ppt_end", "tok_s_first", "tok_s_last",
        "train_ppt_first", "train_ppt_last", "train_exit_first", "train_exit_last", "exit_entropy_last",
        "penalty_last", "train_solve_last")


def aggregate(runs: list[Run]) -> dict:
    """Per price: the seeds' means ± SE, and pass@1 pooled over seeds and problems."""
    from rltt.evaluation.results import pool_object

    ok = [r for r in runs if not r.error and r.summary]
    out: dict = {"seeds": len(ok)}
    for key in KEYS:
        out[key], out[key + "_se"] = mean_se([r.summary[key] for r in ok])
    if ok:
        pooled = pool_object(",".join(str(r.eval_file) for r in ok), BOOTSTRAP, 0)["summary"]["pass@1"]
        out["pass1"], out["pass1_se"] = pooled["mean"], pooled["se"]
        out["files"] = [str(r.eval_file) for r in ok]
    return out


def compare(result: dict, base: dict) -> dict:
    """pass@1 of a price minus λ = 0's on their common problems: mean, SE, p-value."""
    from rltt.evaluation.results import compare_object

    obj = compare_object(",".join(result["files"]), ",".join(base["files"]), BOOTSTRAP, 0)
    return obj["difference"]["pass@1"]


def goal(result: dict, base: dict) -> str:
    """Whether the price met the goal against λ = 0 (met / missed with the reason)."""
    diff = result.get("diff")
    if diff is None or not math.isfinite(base.get("exit_end", float("nan"))):
        return "–"
    fall = 1 - result["exit_end"] / base["exit_end"]
    solve_ok = diff["mean"] >= -SOLVE_SE_GOAL * diff["se"]
    if fall >= EXIT_FALL_GOAL and solve_ok:
        return f"met (exit −{100 * fall:.0f} %)"
    reasons = []
    if fall < EXIT_FALL_GOAL:
        reasons.append(f"exit −{100 * fall:.0f} % < {100 * EXIT_FALL_GOAL:.0f} %")
    if not solve_ok:
        reasons.append(f"solve rate {diff['mean'] / diff['se'] if diff['se'] > 0 else float('-inf'):.1f} SE")
    return "missed: " + ", ".join(reasons)


def _pm(x: float, se: float, fmt: str = ".3f") -> str:
    if not math.isfinite(x):
        return "–"
    return f"{x:{fmt}}" + (f" ± {se:{fmt}}" if math.isfinite(se) else "")


def _arrow(a: float, b: float, fmt: str = ".2f") -> str:
    show = lambda x: f"{x:{fmt}}" if math.isfinite(x) else "–"  # noqa: E731
    return f"{show(a)} → {show(b)}"


def format_table(results: dict[float, dict], steps: int, samples: int) -> str:
    lines = [f"| λ | seeds | held-out pass@1 ({steps} steps, {samples} samples) | Δ vs λ = 0 (pts, p) | "
             "mean exit step (start → end) | passes/token (start → end) | "
             "rollout tokens/s (first → last tenth) | train exit step (first → last tenth) | "
             "reward/compute (late) | goal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for lam, r in results.items():
        if not r.get("seeds"):
            lines.append(f"| {lam:g} | 0 | failed | | | | | | | |")
            continue
        diff = r.get("diff")
        delta = "(baseline)" if diff is None else \
            f"{100 * diff['mean']:+.1f} ± {100 * diff['se']:.1f} (p {diff['p_value']:.2g})"
        lines.append(f"| {lam:g} | {r['seeds']} | {_pm(r['pass1'], r['pass1_se'])} | {delta} | "
                     f"{_arrow(r['exit_start'], r['exit_end'])} | {_arrow(r['ppt_start'], r['ppt_end'])} | "
                     f"{_arrow(r['tok_s_first'], r['tok_s_last'], '.0f')} | "
                     f"{_arrow(r['train_exit_first'], r['train_exit_last'])} | {r['penalty_last']:.3f} | "
                     f"{r.get('goal', '–')} |")
    return "\n".join(lines) + "\n"


def rollout_speed(runs: list[Run], steps: int, prompts: int, repeats: int) -> dict[float, dict]:
    """Per price, its first seed's final checkpoint rolled out in this process on the same held-out
    prompts with the recipe's sampling (deferred schedule, sampled exits, G rows per prompt, one
    thread), the prices interleaved ``repeats`` times: completion tokens per CPU second of the
    fastest rollout, serial passes of the batch and per token (each row's passes over its tokens)."""
    import torch

    from rltt.data.prompts import recipe_prompt_renderer
    from rltt.orchestration.engines import make_engine
    from rltt.orchestration.policy import load_policy, sampling_params, stop_ids
    from rltt.orchestration.prompt_stream import eval_tasks
    from rltt.orchestration.train_recipe import load_train_recipe

    torch.set_num_threads(1)
    first = {}
    for run in runs:
        if not run.error and run.summary and run.lam not in first:
            first[run.lam] = run
    if not first:
        return {}
    recipe = load_train_recipe(ROOT / RECIPE, [a for a in first[min(first)].train_argv[2:] if "=" in a])
    engines, tokenizer = {}, None
    for lam, run in first.items():
        net, tokenizer = load_policy(run.run_dir / "checkpoints" / f"step-{steps:07d}", recipe.model.dtype, "cpu",
                                     recipe.model.convert)
        engines[lam] = make_engine(recipe.rollout, net.eval())
    d = recipe.data
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    tasks = eval_tasks(d.eval_source, d.source, encode, recipe_prompt_renderer(d, tokenizer), d.eval_split, prompts,
                       d.seed)
    params = sampling_params(recipe.rollout, stop_ids(tokenizer), tokenizer.decode, n=recipe.rollout.group_size,
                             seed=recipe.seed)
    best: dict[float, dict] = {}
    for _ in range(repeats):
        for lam, engine in engines.items():
            start = time.process_time()
            batch = engine.generate([t.prompt_ids for t in tasks], params)
            cpu = time.process_time() - start
            stats = batch.stats
            row_passes = float(stats.row_passes.sum()) if stats.row_passes is not None else float("nan")
            row = {"group": params.n, "tokens": stats.tokens, "cpu_s": cpu, "tok_per_cpu_s": stats.tokens / cpu,
                   "passes": stats.passes, "passes_per_token": row_passes / max(1, stats.tokens),
                   "mean_exit": float(batch.exit_steps[batch.action_mask].float().mean())}
            if lam not in best or row["tok_per_cpu_s"] > best[lam]["tok_per_cpu_s"]:
                best[lam] = row
    return best


def format_speed(speed: dict[float, dict], prompts: int, repeats: int) -> str:
    if not speed:
        return ""
    group = next(iter(speed.values()))["group"]
    base = speed.get(0.0, {}).get("tok_per_cpu_s", float("nan"))
    lines = [f"Same-process rollouts of each price's seed-0 final checkpoint ({prompts} held-out prompts × G = {group}, "
             f"deferred schedule, sampled exits, one thread, fastest of {repeats}):", "",
             "| λ | completion tokens | mean exit step | serial passes (batch) | passes/token (per row) | "
             "tokens per CPU s | × λ = 0 |", "|---|---|---|---|---|---|---|"]
    for lam, r in speed.items():
        lines.append(f"| {lam:g} | {r['tokens']} | {r['mean_exit']:.2f} | {r['passes']} | {r['passes_per_token']:.2f} | "
                     f"{r['tok_per_cpu_s']:.0f} | {r['tok_per_cpu_s'] / base:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = build_runs(args)
    print(f"{len(runs)} runs of `rltt train {RECIPE} rollout.exit_policy={EXIT_POLICY}` + `rltt eval` into "
          f"{args.out}", file=sys.stderr)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        done = list(pool.map(lambda r: execute(r, args), runs))
    results = {lam: aggregate([r for r in done if r.lam == lam]) for lam in args.lambdas}
    base = results[0.0]
    for lam, r in results.items():
        if lam != 0.0 and r.get("seeds") and base.get("seeds"):
            r["diff"] = compare(r, base)
            r["goal"] = goal(r, base)
    table = format_table(results, args.steps, args.eval_samples)
    speed = rollout_speed(done, args.steps, args.speed_prompts, args.speed_repeats) if args.speed_repeats else {}
    if speed:
        table += "\n" + format_speed(speed, args.speed_prompts, args.speed_repeats)
    report = {"steps": args.steps, "seeds": args.seeds, "eval_samples": args.eval_samples, "smoke": args.smoke,
              "exit_action": args.exit_action, "compute_price": args.compute_price,
              "speed": {f"{lam:g}": r for lam, r in speed.items()},
              "results": {f"{lam:g}": r for lam, r in results.items()},
              "runs": [{"lambda": r.lam, "seed": r.seed, "train": command(r.train_argv), "eval": command(r.eval_argv),
                        "run_dir": str(r.run_dir), "seconds": r.seconds, "error": r.error, **r.summary}
                       for r in done]}
    (args.out / "compute.json").write_text(json.dumps(report, indent=2))
    (args.out / "compute.md").write_text(table)
    print(table)
    return 1 if any(r.error for r in done) else 0


if __name__ == "__main__":
    sys.exit(main())
