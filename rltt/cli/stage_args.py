"""What ``rltt pretrain`` and ``rltt convert`` share: arguments and the run report."""

from __future__ import annotations

import argparse

from rltt.lm_training.stage_loop import StageResult


def add_stage_arguments(parser: argparse.ArgumentParser) -> None:
    from rltt.runtime.stop import help_text

    parser.epilog = help_text() + (" One run at a time per logging.run_dir (a second one is refused: the folder is "
                                   "locked).")
    parser.add_argument("recipe", metavar="RECIPE.yaml", help="stage recipe (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted recipe overrides, e.g. train.steps=100 optim.lr=1e-3")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in logging.run_dir")


def report(result: StageResult) -> None:
    """Print where the model is and the last evaluation."""
    print(f"{result.step} steps in {result.wall_time_s:.0f}s; model: {result.final_dir}")
    shown = {k: v for k, v in result.eval.items() if k in ("eval/lm_loss", "eval/solve_rate", "eval/exit/mean_step")}
    if shown:
        print("  " + "  ".join(f"{k}={v:.4g}" for k, v in shown.items()))
    for alarm in result.alarms:
        print(f"  ALARM step {alarm['step']}: {alarm['message']}")
