"""``rltt convert RECIPE.yaml [key=value ...] [--resume]``: dense checkpoint → LoopLM."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``convert`` sub-command."""
    from rltt.cli.stage_args import add_stage_arguments

    parser = subparsers.add_parser(
        "convert", help="convert a dense HF checkpoint into a LoopLM and train it (e.g. recipes/convert-tiny.yaml)",
        description="Wrap a local dense Qwen3/Qwen2/Llama checkpoint as a looped model (loopify) and train it "
                    "with the smoothed exit loss (1-eps) sum_t p_t L_t + eps/T sum_t L_t - beta H(p).")
    add_stage_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rltt.cli.stage_args import report
    from rltt.lm_training.conversion import convert, load_convert_recipe

    recipe = load_convert_recipe(args.recipe, args.overrides)
    report(convert(recipe, resume=args.resume, recipe_file=args.recipe))
    return 0
