"""The command line: ``python bench/gpu_check --out DIR [--cpu-smoke] [--sections a,b] [--budget-scale X]``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .context import HEAVY, ROOT, Context, block_heavy_modules, environment
from .deepspeed_run import section_deepspeed
from .engine import section_engine
from .imports import section_imports
from .kernels import section_kernels
from .learner import section_learner
from .plan import section_plan
from .report import SectionResult, Terminated, log, markdown, on_sigterm, run_section, write_outputs
from .rollouts import section_rollouts
from .smoke import section_smoke
from .vllm_run import section_vllm

#: the sections in the order a full run takes them (the engine first: it is what a short device call is for)
FUNCS = dict(engine=section_engine, imports=section_imports, kernels=section_kernels, rollouts=section_rollouts,
             learner=section_learner, plan=section_plan, deepspeed=section_deepspeed, vllm=section_vllm,
             smoke=section_smoke)
SECTIONS = tuple(FUNCS)


def parse_args(argv=None) -> argparse.Namespace:
    from . import __doc__ as doc

    parser = argparse.ArgumentParser(prog="python bench/gpu_check", description=doc.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the same code paths at the smallest shapes on CPU (Triton under its interpreter)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time budget")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        parser.error(f"--sections: unknown section {bad[0]!r} (choose from {', '.join(SECTIONS)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # the kernels must compile for the GPU
    block_heavy_modules()
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu-smoke on a machine without one)", file=sys.stderr)
        return 2
    if args.cpu_smoke:
        torch.set_num_threads(1)  # tiny shapes: OpenMP threads only stall on shared cores
    ctx = Context(args.cpu_smoke, args.budget_scale)
    report = dict(command="python bench/gpu_check " + " ".join(sys.argv[1:] if argv is None else argv),
                  env=environment(ctx), sections={}, total_s=0.0)
    signal.signal(signal.SIGTERM, on_sigterm)  # the outer `timeout`: write what was measured, then exit
    for name in args.sections:
        try:
            result = run_section(name, FUNCS[name], ctx)
        except Terminated:
            report["sections"][name] = asdict(ctx.running) if ctx.running is not None else {}
            for later in args.sections[args.sections.index(name) + 1:]:
                report["sections"][later] = asdict(SectionResult(later, 0.0, status="not run (SIGTERM)"))
            report["total_s"] = round(time.perf_counter() - started, 2)
            write_outputs(report, args.out)
            log("terminated by SIGTERM: the JSON and Markdown hold what was measured")
            return 143
        report["sections"][name] = asdict(result)
        report["total_s"] = round(time.perf_counter() - started, 2)
        write_outputs(report, args.out)  # after every section: a killed run still leaves its figures
    report["env"]["heavy_modules_loaded"] = sorted(
        m for m in sys.modules if m.split(".")[0] in HEAVY and sys.modules[m] is not None)
    report["total_s"] = round(time.perf_counter() - started, 2)
    write_outputs(report, args.out)
    print(markdown(report))
    return 0 if all(s["status"] in ("ok", "absent") for s in report["sections"].values()) else 1


