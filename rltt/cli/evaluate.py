"""``rltt eval RECIPE.yaml [key=value ...]``: held-out solve rate and mean reward of a policy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` sub-command."""
    parser = subparsers.add_parser(
        "eval", help="held-out solve rate and mean reward of the recipe's policy (or --model)",
        description="Sample the recipe's policy on its eval source (data.eval_source, or held-out problems of "
                    "data.source) with the recipe's rewards; defaults match the evaluation `rltt train` logs.")
    parser.add_argument("recipe", metavar="RECIPE.yaml", help="train recipe: policy, sampling, rewards, data")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted recipe overrides")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="checkpoint to evaluate, e.g. RUN_DIR/checkpoints/step-0000020 (default: model.path)")
    parser.add_argument("--samples", type=int, default=None, metavar="K",
                        help="completions per prompt (default: train.eval_samples)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature, 0 = greedy (default: train.eval_temperature)")
    parser.add_argument("--source", default=None, metavar="DATA", help="eval data (default: data.eval_source)")
    parser.add_argument("--split", default=None, help="eval split (default: data.eval_split)")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="prompts (default: data.eval_size)")
    parser.add_argument("--out", default=None, metavar="JSON", help="also write the result (with per-prompt rates)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rltt.curation.recipes import evaluate_recipe
    from rltt.orchestration.train_recipe import load_train_recipe

    recipe = load_train_recipe(args.recipe, args.overrides)
    report = evaluate_recipe(recipe, samples=args.samples, split=args.split, limit=args.limit, source=args.source,
                             temperature=args.temperature, recipe_root=Path(args.recipe).resolve().parent,
                             model=args.model)
    print(report.summary())
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"written: {out}")
    return 0
