"""``rltt pretrain RECIPE.yaml [key=value ...] [--resume]``: pretrain a LoopLM from scratch."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``pretrain`` sub-command."""
    from rltt.cli.stage_args import add_stage_arguments

    parser = subparsers.add_parser(
        "pretrain", help="pretrain a looped LM from scratch (e.g. recipes/pretrain-tiny.yaml)",
        description="Train a tokenizer and a LoopLM from scratch with L = sum_t p_t L_t - beta H(p); "
                    "metrics to RUN_DIR/metrics.jsonl, checkpoints to RUN_DIR/checkpoints, the final model to "
                    "RUN_DIR/final, where RUN_DIR is the recipe's logging.run_dir.")
    add_stage_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rltt.cli.stage_args import report
    from rltt.lm_training.pretraining import load_pretrain_recipe, pretrain

    recipe = load_pretrain_recipe(args.recipe, args.overrides)
    report(pretrain(recipe, resume=args.resume, recipe_file=args.recipe))
    return 0
