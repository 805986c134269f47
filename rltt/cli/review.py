"""``rltt review RUN_DIR [--compare OTHER_RUN] [--out DIR]``: a run's health report."""

from __future__ import annotations

import argparse

#: ``--fail-on`` choices → the lowest severity rank (Severity.rank) that makes the command
#: exit with 1. (The telemetry modules are imported when the command runs, keeping
#: ``rltt --help`` fast.)
FAIL_ON = {"never": None, "warning": 1, "critical": 2}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``review`` sub-command."""
    parser = subparsers.add_parser(
        "review",
        help="health report of a run: plots and diagnoses from RUN_DIR/metrics.jsonl",
        description="Read RUN_DIR/metrics.jsonl (a run still writing is fine), diagnose "
                    "common failures (policy not moving, uniform groups, exit-gate collapse, "
                    "gradient vanishing, spikes, log-prob mismatch, reward errors, truncation) "
                    "and write RUN_DIR/review/report.md and a self-contained report.html.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding metrics.jsonl")
    parser.add_argument("--compare", metavar="OTHER_RUN",
                        help="another run directory to overlay on the plots")
    parser.add_argument("--out", metavar="DIR",
                        help="where to write the report (default: RUN_DIR/review)")
    parser.add_argument("--no-plots", action="store_true", help="diagnoses and reports only")
    parser.add_argument("--fail-on", choices=sorted(FAIL_ON), default="never",
                        help="exit with status 1 when a diagnosis of this severity or worse "
                             "fired (default: never)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Review, print the summary; the exit status follows ``--fail-on``."""
    from rltt.telemetry.run_review import format_summary, review

    report = review(args.run_dir, compare=args.compare, out_dir=args.out,
                    plots=not args.no_plots)
    print(format_summary(report))
    threshold = FAIL_ON[args.fail_on]
    if threshold is not None and report.worst is not None and report.worst.rank >= threshold:
        return 1
    return 0
