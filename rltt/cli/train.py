"""``rltt train RECIPE.yaml [key=value ...] [--resume]``: RLTT/GRPO post-training of a looped model.

Data-parallel over N processes (GPUs): ``torchrun --nproc_per_node N -m rltt.cli.main train RECIPE.yaml
learner.backend=deepspeed`` — each rank samples prompts_per_step / N of every step's prompts.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    from rltt.runtime.stop import help_text

    parser = subparsers.add_parser(
        "train", help="RL post-training (e.g. recipes/quickstart.yaml, recipes/gsm8k.yaml)",
        description="prompts -> rollouts -> rewards -> advantages -> learner updates -> weight sync; metrics in "
                    "RUN_DIR/metrics.jsonl, checkpoints in RUN_DIR/checkpoints, a health review at the end. "
                    "One run at a time per RUN_DIR (a second one is refused: the folder is locked).",
        epilog=help_text())
    parser.add_argument("recipe", metavar="RECIPE.yaml", help="train recipe (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. train.steps=50 learner.lr=1e-5 rollout.group_size=4")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in run_dir")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.orchestration.trainer import train

    recipe = load_train_recipe(args.recipe, args.overrides)
    # one loop; orchestration.backend says where its engine and learner live (here or on Ray actors)
    result, trainer = train(recipe, resume=args.resume, recipe_root=Path(args.recipe).resolve().parent)
    trainer.ranks.close()
    if not trainer.ranks.main:  # rank 0 reports for a data-parallel run
        return 0
    print(f"{result.steps} steps; run: {result.run_dir}")
    if result.initial_solve_rate is not None and result.final_solve_rate is not None:
        gain = 100 * (result.final_solve_rate - result.initial_solve_rate)
        print(f"held-out solve rate: {result.initial_solve_rate:.3f} -> {result.final_solve_rate:.3f} "
              f"({gain:+.1f} points)")
    review = result.run_dir / "review" / "report.md"
    if review.exists():
        print(f"health review: {review}")
    return 0
