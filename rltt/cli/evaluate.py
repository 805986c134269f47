"""``rltt eval RECIPE.yaml [key=value ...]``: held-out solve rate, pass@1 … pass@k and mean@k with
bootstrap intervals; ``rltt eval --compare A B``: the paired difference of two results with its
interval and p-value; ``rltt eval --pool A``: several runs of one configuration pooled."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from rltt.errors import RlttError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` sub-command."""
    parser = subparsers.add_parser(
        "eval", help="pass@k / solve rate with 95%% intervals of the recipe's policy; --compare A B: paired test",
        description="Sample the recipe's policy on its eval source (data.eval_source, or held-out problems of "
                    "data.source) with the recipe's rewards; defaults match the evaluation `rltt train` logs. "
                    "With --samples K it reports pass@1 ... pass@K (unbiased estimator) and mean@K, each with "
                    "a bootstrap standard error and 95 % interval over problems. --compare A B compares two "
                    "results (files written by --out, run directories holding eval.json, or several of them "
                    "joined by commas / a glob, pooled as runs) on their common problems: A - B's standard "
                    "error, 95 % interval (the test inverted) and p-value all come from one test (--test).")
    parser.add_argument("recipe", nargs="?", metavar="RECIPE.yaml",
                        help="train recipe: policy, sampling, rewards, data")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted recipe overrides")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="checkpoint to evaluate, e.g. RUN_DIR/checkpoints/step-0000020 (default: model.path)")
    parser.add_argument("--samples", type=int, default=None, metavar="K",
                        help="completions per prompt; reports pass@1 ... pass@K (default: train.eval_samples)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature, 0 = greedy (default: train.eval_temperature)")
    parser.add_argument("--source", default=None, metavar="DATA", help="eval data (default: data.eval_source)")
    parser.add_argument("--split", default=None, help="eval split (default: data.eval_split)")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="prompts (default: data.eval_size)")
    parser.add_argument("--exit-policy", default=None, metavar="POLICY",
                        help="exit policy to score with: final | fixed:k | threshold:q | sample (default: "
                             "train.eval_exit_policy, else rollout.exit_policy); the mean exit step and passes "
                             "per token it took are reported beside the solve rate")
    parser.add_argument("--out", default=None, metavar="JSON",
                        help="also write the result object (summary and per-problem counts), e.g. RUN_DIR/eval.json")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of text")
    parser.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"),
                        help="paired difference A - B of two results (no recipe): each a result file, a run "
                             "directory with eval.json, or several joined by commas or a quoted glob (pooled runs)")
    parser.add_argument("--pool", default=None, metavar="A",
                        help="the pooled summary of several results of one configuration (no recipe)")
    parser.add_argument("--bootstrap", type=int, default=None, metavar="B",
                        help="bootstrap replicates of the pass@k summaries (default 2000)")
    parser.add_argument("--stats-seed", type=int, default=0, metavar="S", help="seed of the bootstrap and permutations")
    parser.add_argument("--test", default="auto", choices=("auto", "problems", "runs"),
                        help="--compare: the test behind A - B's SE, interval and p-value: sign flips over problems "
                             "(runs held fixed), permutation of whole runs (problems held fixed), or auto "
                             "(runs when both sides have >= 2 runs)")
    parser.add_argument("--permutations", type=int, default=None, metavar="R",
                        help="--compare: random sign flips / relabellings when not enumerated (default 10000)")
    parser.set_defaults(func=run)


def _emit(obj: dict, lines: list[str], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(obj) + "\n")
    else:
        print("\n".join(lines))


def _stats_args(args: argparse.Namespace) -> tuple[int, int]:
    from rltt.evaluation.compare import DEFAULT_PERMUTATIONS
    from rltt.evaluation.intervals import DEFAULT_REPS

    reps = DEFAULT_REPS if args.bootstrap is None else args.bootstrap
    permutations = DEFAULT_PERMUTATIONS if args.permutations is None else args.permutations
    if reps < 2:
        raise RlttError(f"--bootstrap: must be >= 2, got {reps}")
    if permutations < 1:
        raise RlttError(f"--permutations: must be >= 1, got {permutations}")
    return reps, permutations


def run(args: argparse.Namespace) -> int:
    reps, permutations = _stats_args(args)
    if args.compare or args.pool:
        return _run_results(args, reps, permutations)
    if not args.recipe:
        raise RlttError("give a RECIPE.yaml to evaluate, or --compare A B / --pool A to read results")
    return _run_recipe(args, reps)


def _run_results(args: argparse.Namespace, reps: int, permutations: int) -> int:
    from rltt.evaluation.results import compare_lines, compare_object, pool_object, summary_lines

    if args.compare and args.pool:
        raise RlttError("--compare and --pool: give one of them")
    if args.recipe or args.overrides:
        raise RlttError("--compare / --pool read results and take no recipe")
    if args.compare:
        obj = compare_object(args.compare[0], args.compare[1], reps, args.stats_seed, args.test, permutations)
        _emit(obj, compare_lines(obj), args.json)
    else:
        obj = pool_object(args.pool, reps, args.stats_seed)
        info = obj["bootstrap"]
        _emit(obj, [f"{info['runs']} run(s) pooled on {info['problems']} common problems: {', '.join(obj['files'])}",
                    *summary_lines(obj["summary"])], args.json)
    return 0


def _exit_policy(spec: str | None):
    """--exit-policy parsed (once, before the model loads: a bad policy is one line), or None: the
    recipe's evaluation policy (train.eval_exit_policy, else the rollout's)."""
    from rltt.model.exits import ExitPolicy

    return None if spec is None else ExitPolicy.parse(spec, None, field="--exit-policy")


def _run_recipe(args: argparse.Namespace, reps: int) -> int:
    from rltt.evaluation.results import result_object, summary_lines
    from rltt.orchestration.evaluator import evaluate_recipe
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.runtime.device import require_cuda

    # --json: stdout carries the one JSON object; what loading prints (library banners) goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        policy = _exit_policy(args.exit_policy)
        recipe = load_train_recipe(args.recipe, args.overrides)
        require_cuda(recipe.model.device)  # a GPU recipe where CUDA is unusable: one line, before any work
        report = evaluate_recipe(recipe, samples=args.samples, split=args.split, limit=args.limit,
                                 source=args.source, temperature=args.temperature, exit_policy=policy,
                                 recipe_root=Path(args.recipe).resolve().parent, model=args.model)
    base = report.to_dict()
    counts = report.result.counts(report.model)  # the evaluator's counts, not rebuilt from its rates
    passes = report.result.passes_per_token
    meta = {**base, "seed": recipe.seed, "engine": recipe.rollout.engine, "schedule": recipe.rollout.schedule,
            "exit_policy": report.exit_policy, "passes_per_token": passes}
    obj = result_object(meta, counts, reps, args.stats_seed)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(obj, indent=1) + "\n")
    shown = report.exit_policy or "the model's own"
    lines = [report.summary(),
             f"exit policy {shown}: mean exit step {report.result.mean_exit_step:.3f}, passes/token "
             + (f"{passes:.3f} ({recipe.rollout.schedule} schedule)" if passes is not None else "not counted"),
             *summary_lines(obj["summary"])]
    if args.out:
        lines.append(f"written: {args.out}")
    _emit(obj, lines, args.json)
    return 0
