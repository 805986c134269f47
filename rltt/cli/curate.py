"""``rltt curate RECIPE.yaml [key=value ...] --out PATH``: keep the prompts the policy solves sometimes.

Samples K completions per prompt of the recipe's data source with the recipe's policy, engine,
sampling settings and rewards; writes every prompt's solve rate (resumable: a rerun skips the
prompts already written), the in-band prompts as a GSM8K file for ``data.source``, and a histogram.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``curate`` sub-command."""
    from rltt.runtime.stop import EXIT_STOPPED

    parser = subparsers.add_parser(
        "curate", help="solve-rate curation: keep prompts with 0.1 <= solve rate <= 0.9 (docs/design.md §5.10)",
        description="Sample K completions per prompt with the recipe's policy, store each prompt's solve rate in "
                    "PATH (.jsonl or .parquet; a rerun resumes it), keep the band, and write the kept prompts "
                    "as a GSM8K file (PATH stem + .kept.jsonl/.parquet) and a histogram (PATH stem + .hist.png).")
    parser.epilog = (f"SIGTERM / SIGINT: the block of prompts in flight may finish within train.stop_grace_s (else it "
                     f"is abandoned), every finished block stays in PATH, and the command exits with status "
                     f"{EXIT_STOPPED}; run the same command again to continue. A second signal exits at once.")
    parser.add_argument("recipe", metavar="RECIPE.yaml", help="train recipe: policy, sampling, rewards, data")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted recipe overrides")
    parser.add_argument("--out", required=True, metavar="PATH", help="records file: .jsonl or .parquet")
    parser.add_argument("--samples", type=int, default=None, metavar="K",
                        help="completions per prompt (default: rollout.group_size)")
    parser.add_argument("--band", default="0.1,0.9", metavar="LO,HI",
                        help="kept solve-rate band, inclusive (default: 0.1,0.9)")
    parser.add_argument("--source", default=None, metavar="DATA",
                        help="prompts to curate (default: data.source): a GSM8K JSONL/Parquet file or directory, "
                             "a hub id, or synthetic[:PRESET] with --limit")
    parser.add_argument("--split", default=None, help="split of a directory or hub source (default: data.split)")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="the first N prompts only")
    parser.add_argument("--kept", default=None, metavar="PATH", help="where to write the kept GSM8K set")
    parser.add_argument("--model", default=None, metavar="PATH", help="policy checkpoint (default: model.path)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rltt.curation.histogram import Band
    from rltt.curation.recipes import curate_recipe
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.runtime.device import require_cuda

    from rltt.curation.curation_loop import CurationPaths

    band = Band.parse(args.band)
    recipe = load_train_recipe(args.recipe, args.overrides)
    require_cuda(recipe.model.device)  # a GPU recipe where CUDA is unusable: one line, before any work
    # the outputs never overwrite an input: the recipe file or the data source
    CurationPaths.for_output(args.out, args.kept, {"the recipe file": args.recipe,
                                                   "the data source": args.source or recipe.data.source})
    result = curate_recipe(recipe, args.out, samples=args.samples, band=band, source=args.source,
                           split=args.split, limit=args.limit, kept=args.kept,
                           recipe_root=Path(args.recipe).resolve().parent, model=args.model,
                           progress=not args.no_progress)
    print(result.summary())
    return 0
