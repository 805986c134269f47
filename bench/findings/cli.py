"""The command line: parse the flags, build the arms of the chosen findings, run them (or resume,
or only rebuild the report), then write ``OUT/findings.json``, ``OUT/findings.md`` and a figure per
finding."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from . import __doc__ as package_doc
from .band import band_arms, band_results
from .credit import CREDIT, credit_arms, credit_results
from .dense import dense_arms, dense_results
from .depth import depth_arms, depth_results
from .lr import lr_arms, lr_results
from .metrics import read_records
from .figures import plot_band, plot_credit, plot_dense, plot_depth, plot_lr
from .markdown import header, md_band, md_credit, md_dense, md_depth, md_lr
from .runner import FULL, ROOT, SMOKE, Arm, Scale, rel, run_arms

FINDINGS = ("band", "lr", "dense", "credit", "depth")
#: how the report names this command
COMMAND = "python bench/findings"


def finished(arm: Arm) -> bool:
    """Whether a CLI arm's outputs in --out are complete (a train run: its last step logged with
    the final evaluation; a pretraining run: its summary; a curation: its kept set)."""
    if arm.argv[0] == "curate":
        kept = Path(arm.argv[arm.argv.index("--kept") + 1])
        return (kept if kept.is_absolute() else ROOT / kept).is_file()
    if arm.argv[0] == "pretrain":
        return (arm.run_dir / "summary.json").is_file()
    if arm.argv[0] == "eval":
        written = Path(arm.argv[arm.argv.index("--out") + 1])
        return (written if written.is_absolute() else ROOT / written).is_file()
    if not (arm.run_dir / "metrics.jsonl").is_file():
        return False
    steps = int(next(a for a in arm.argv if a.startswith("train.steps=")).partition("=")[2])
    last = read_records(arm.run_dir)[-1:]
    return bool(last) and last[0]["step"] == steps and "eval/solve_rate" in last[0]


def mark_finished(arms: dict[str, Arm], report_only: bool) -> None:
    """``--report-only`` / ``--resume``: an arm whose outputs are complete counts as done
    (in-process arms run again: they only write the pool file or look the cached model up).
    ``--report-only`` marks the others failed; ``--resume`` removes their partial run
    directories and leaves them to run."""
    for arm in arms.values():
        if arm.fn is not None:
            arm.fn()
            arm.status = "done"
        elif finished(arm):
            arm.status = "done"
        elif report_only:
            arm.status, arm.error = "failed", "no complete outputs in --out"
        elif arm.run_dir is not None:
            shutil.rmtree(arm.run_dir, ignore_errors=True)


def build_arms(out: Path, scale: Scale, only: tuple[str, ...], retrain_t4: bool, t4_info: dict) -> dict[str, Arm]:
    arms: dict[str, Arm] = {}
    if "band" in only:
        arms.update(band_arms(out, scale))
    if "lr" in only:
        arms.update(lr_arms(out, scale))
    if "dense" in only:
        arms.update(dense_arms(out, scale, retrain_t4, t4_info))
    if "credit" in only:
        arms.update(credit_arms(out, scale))
    if "depth" in only:
        arms.update(depth_arms(out, scale))
    return arms


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=package_doc.splitlines()[0])
    parser.add_argument("--out", default="runs/bench-findings", help="output directory (default runs/bench-findings)")
    parser.add_argument("--smoke", action="store_true", help="one seed, a few steps per arm, tiny evaluations")
    parser.add_argument("--jobs", type=int, default=2, help="arms run at once (one CPU thread each; default 2)")
    parser.add_argument("--only", default=",".join(FINDINGS), help=f"findings to run (default {','.join(FINDINGS)})")
    parser.add_argument("--seeds", type=int, default=None, help="seeds of the band arms")
    parser.add_argument("--credit-seeds", type=int, default=None, help="seeds of the per-loop credit arms")
    parser.add_argument("--credit-arms", default=None,
                        help=f"comma-separated per-loop credit arms (default all: {','.join(CREDIT)})")
    parser.add_argument("--steps", type=int, default=None, help="RL steps of the band, dense, credit and depth arms")
    parser.add_argument("--dense-seeds", type=int, default=None, help="RL seeds of the dense-twin arms")
    parser.add_argument("--depth-seeds", type=int, default=None, help="RL seeds of the depth arms")
    parser.add_argument("--depth-source", default=None, metavar="synthetic:chains...",
                        help="the depth finding's task (default synthetic:chains, 1-4 hops; synthetic:chains-easy: 0-3)")
    parser.add_argument("--depth-pretrain-override", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override of both depth pretraining arms, e.g. model.config.hidden_size=256 "
                             "(repeatable; the same block for T = 4 and T = 1)")
    parser.add_argument("--depth-pretrain-steps", type=int, default=None, help="pretraining steps of the depth arms")
    parser.add_argument("--lr-steps", type=int, default=None, help="RL steps of the learning-rate arms")
    parser.add_argument("--eval-size", type=int, default=None, help="held-out problems per evaluation")
    parser.add_argument("--retrain-t4", action="store_true",
                        help="run the T = 4 pretraining too (default: reuse the cached quickstart model)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rebuild the JSON, Markdown and figures from the runs already in --out")
    parser.add_argument("--resume", action="store_true",
                        help="keep the complete arms already in --out and run the rest (after an interrupted run)")
    parser.add_argument("--figures", default=None, metavar="DIR",
                        help="also copy the PNGs to DIR (e.g. bench/figures) and link them from the Markdown "
                             "relative to bench/")
    args = parser.parse_args(argv)
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    bad = [s for s in only if s not in FINDINGS]
    if bad or not only:
        parser.error(f"--only: unknown finding(s) {bad} (choose from {', '.join(FINDINGS)})")
    args.only = only
    if args.jobs < 1:
        parser.error("--jobs: must be >= 1")
    if args.credit_arms is not None:
        kinds = tuple(s.strip() for s in args.credit_arms.split(",") if s.strip())
        unknown = [k for k in kinds if k not in CREDIT]
        if unknown or not kinds:
            parser.error(f"--credit-arms: unknown arm(s) {unknown} (choose from {', '.join(CREDIT)})")
        args.credit_arms = kinds
    bad = [o for o in args.depth_pretrain_override if "=" not in o or o.startswith(("train.steps=", "data.source=",
                                                                                     "model.config.num_loops="))]
    if bad:
        parser.error(f"--depth-pretrain-override: {bad[0]!r} is not KEY=VALUE, or sets what the finding itself sets "
                     "(train.steps: --depth-pretrain-steps; data.source: --depth-source; model.config.num_loops)")
    if args.depth_source is not None:
        from rltt.data.chains import ChainDifficulty
        from rltt.data.synthetic import resolve_difficulty
        from rltt.errors import RlttError

        preset = args.depth_source.partition(":")[2] if args.depth_source.startswith("synthetic:") else None
        try:
            chains = preset is not None and isinstance(resolve_difficulty(preset), ChainDifficulty)
        except RlttError:
            chains = False
        if not chains:
            parser.error(f"--depth-source: {args.depth_source!r} is not a synthetic:chains... preset")
    return args


def scale_of(args: argparse.Namespace) -> Scale:
    """FULL or SMOKE with the size flags the command line gave."""
    scale = SMOKE if args.smoke else FULL
    for key, value in (("seeds", args.seeds), ("credit_seeds", args.credit_seeds), ("rl_steps", args.steps),
                       ("lr_steps", args.lr_steps), ("eval_size", args.eval_size), ("depth_seeds", args.depth_seeds),
                       ("depth_pretrain_steps", args.depth_pretrain_steps), ("dense_seeds", args.dense_seeds)):
        if value is not None:
            if value < 1:
                raise SystemExit(f"findings: --{key.replace('_', '-')} must be >= 1")
            scale = replace(scale, **{key: value})
    if args.credit_arms:
        scale = replace(scale, credit_arms=args.credit_arms)
    if args.depth_source:
        scale = replace(scale, depth_source=args.depth_source)
    if args.depth_pretrain_override:
        scale = replace(scale, depth_pretrain_overrides=tuple(args.depth_pretrain_override))
    return scale


def execute(arms: dict[str, Arm], out: Path, args: argparse.Namespace) -> float:
    """Run the arms (``--resume``: those not complete; ``--report-only``: none); the wall seconds
    of the run the report is about."""
    start = time.perf_counter()
    if args.report_only:
        mark_finished(arms, report_only=True)
    elif args.resume:
        mark_finished(arms, report_only=False)
        run_arms(arms, out / "logs", args.jobs)
    else:
        for sub in ("runs", "band", "logs", "depth", "dense"):
            shutil.rmtree(out / sub, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        run_arms(arms, out / "logs", args.jobs)
    elapsed = time.perf_counter() - start
    if args.report_only and (out / "findings.json").is_file():  # the time of the run it reports
        elapsed = json.loads((out / "findings.json").read_text()).get("seconds", elapsed)
    return elapsed


def command_line(args: argparse.Namespace, out: Path) -> str:
    """The command that reruns this one (the flags that differ from the defaults)."""
    flags = [f"--out {rel(out)}", *(["--smoke"] if args.smoke else []),
             *([f"--only {','.join(args.only)}"] if args.only != FINDINGS else []),
             *([f"--credit-arms {','.join(args.credit_arms)}"] if args.credit_arms else []),
             *([f"--depth-source {args.depth_source}"] if args.depth_source else []),
             *(f"--depth-pretrain-override {o}" for o in args.depth_pretrain_override),
             *(f"--{k.replace('_', '-')} {v}" for k, v in (("seeds", args.seeds), ("credit_seeds", args.credit_seeds),
                                                          ("steps", args.steps),
                                                          ("lr_steps", args.lr_steps), ("eval_size", args.eval_size),
                                                          ("depth_seeds", args.depth_seeds),
                                                          ("depth_pretrain_steps", args.depth_pretrain_steps),
                                                          ("dense_seeds", args.dense_seeds))
               if v is not None),
             *([f"--jobs {args.jobs}"] if args.jobs != 2 else []), *(["--retrain-t4"] if args.retrain_t4 else [])]
    return COMMAND + " " + " ".join(flags)


def run(args: argparse.Namespace) -> dict:
    scale = scale_of(args)
    out = Path(args.out).resolve()
    t4_info: dict = {}
    arms = build_arms(out, scale, args.only, args.retrain_t4, t4_info)
    elapsed = execute(arms, out, args)

    figures = {}
    results: dict = {}
    builders = {"band": (lambda: band_results(out, arms, scale), plot_band, md_band),
                "lr": (lambda: lr_results(arms, scale), plot_lr, md_lr),
                "dense": (lambda: dense_results(out, arms, scale, t4_info), plot_dense, md_dense),
                "credit": (lambda: credit_results(arms, scale), plot_credit, md_credit),
                "depth": (lambda: depth_results(out, arms, scale), plot_depth, md_depth)}
    sections = []
    fig_dir = Path(args.figures).resolve() if args.figures else None
    for name in args.only:
        compute, plot, md = builders[name]
        results[name] = compute()
        png = out / f"{name}.png"
        plot(results[name], png)
        link = png.name
        if fig_dir is not None:
            fig_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(png, fig_dir / f"findings-{name}.png")
            link = os.path.relpath(fig_dir / f"findings-{name}.png", ROOT / "bench")
        figures[name] = str(png)
        sections.append(md(results[name], arms, scale, link))

    failed = {a.name: a.error for a in arms.values() if a.status != "done"}
    markdown = header(command_line(args, out), args.smoke, len(arms), args.jobs, elapsed, failed) + "\n" + \
        "\n".join(sections)
    (out / "findings.md").write_text(markdown)
    report = {"mode": "smoke" if args.smoke else "full", "seconds": elapsed, "scale": vars(scale),
              "only": list(args.only),
              "arms": {a.name: {"command": a.command, "status": a.status, "seconds": round(a.seconds, 1),
                                "error": a.error, "run_dir": str(a.run_dir) if a.run_dir else None}
                       for a in arms.values()},
              "results": results, "figures": figures, "failed": failed}
    (out / "findings.json").write_text(json.dumps(report, indent=1, default=str))
    print(markdown)
    print(f"\nwrote {out / 'findings.md'}, {out / 'findings.json'} and {len(figures)} figure(s); "
          f"{len(failed)} arm(s) not done; total {elapsed:.0f}s", file=sys.stderr)
    return report


def main(argv=None) -> int:
    report = run(parse_args(argv))
    return 1 if report["failed"] else 0
