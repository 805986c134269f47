"""What the tools' and the environments' isolation costs, against the same work done in-process.

    python bench/env_overhead.py                 # 40 calls of each (about 30 s on 2 CPU cores)
    python bench/env_overhead.py --calls 200 --rows 64 --workers 2

Measured in one process, interleaved call by call so a change in the machine's load hits every
row alike; medians over ``--calls`` calls of the wall clock (the tools' limits are wall-clock
limits) and of the CPU time the call used in this process and its children (``getrusage``),
which other jobs on a shared machine inflate much less than the wall clock:

- python tool: ``run_tool("python", CODE)`` — a fresh sandboxed interpreter per call
  (rltt/environments/sandbox.py), in bubblewrap's namespaces under the seccomp filter where the
  host allows it — against ``exec`` of the same code in this process with its stdout captured;
  the same call without bubblewrap (``run_python(..., _namespaces=False)``: the sandbox as it was
  before the kernel layers, the audit hook, rlimits, ``unshare`` and Landlock) is the baseline the
  kernel layers' cost is a ratio against (the CPU column misses a confined call's interpreter: it
  runs under bubblewrap's init, which is killed, not reaped through this process); the bare start of the same interpreter (``python -I -S
  -c pass``) says how much of the overhead is process start-up and how much the sandbox's own set-up;
- calculator: ``run_tool("calculator", EXPR)`` (ast whitelist, exact, bounded; in-process)
  against ``eval`` of the same expression;
- environment turn: one turn of ``--rows`` episodes — the batch of `Environment.step` calls the
  episode loop makes after a model turn, apart from generation — run in-process (`InProcessEnv`)
  and isolated (`EnvPool`, ``--workers`` worker processes, started before the timing: a run
  starts its pool once), for the ``annotations`` environment and the ``tools`` environment with
  the calculator (each turn text a calculator call, so every call does the tool's work). The
  replies are checked equal first. The pool's workers are not reaped while it runs, so their CPU
  time is not in the CPU column (wall clock only there).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltt.environments.annotation_env import AnnotationEnvironment  # noqa: E402
from rltt.environments.env_pool import EnvPool, InProcessEnv  # noqa: E402
from rltt.environments.sandbox import isolation, run_python  # noqa: E402
from rltt.environments.tool_env import ToolEnvironment  # noqa: E402
from rltt.environments.tools import ToolLimits, run_tool  # noqa: E402
from rltt.runtime.worker_pool import default_workers  # noqa: E402

PY_CODE = "x = sum(i * i for i in range(100))\nprint(x)"
CALC_EXPR = "123456789123456789 * 987654321987654321 + 1/3"
CALC_EVAL = "123456789123456789 * 987654321987654321 + __import__('fractions').Fraction(1, 3)"
#: a model turn per environment: each one a calculator call
TURNS = {"annotations": " Ann has 61961 + 25337 = <<61961+25337=",
         "tools": 'Let me compute. <tool name="calculator">123456789 * 987654321</tool>'}
ENVS = {"annotations": AnnotationEnvironment, "tools": lambda: ToolEnvironment(["calculator"])}


def _in_process(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<bench>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def _bare_start() -> None:
    subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _timed(fn) -> tuple[float, float]:
    """(wall ms, CPU ms of this process and its reaped children)."""
    cpu, start = _cpu_s(), time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3, (_cpu_s() - cpu) * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rows", type=int, default=64, help="episodes per environment turn (quickstart-tools: 64)")
    parser.add_argument("--workers", type=int, default=None, help="environment worker processes (default: "
                                                                   "half the CPUs, 1 to 4)")
    args = parser.parse_args(argv)
    limits = ToolLimits()
    workers = args.workers or default_workers()

    sandboxed = run_tool("python", PY_CODE, limits)
    assert sandboxed.error is None and sandboxed.output == _in_process(PY_CODE), sandboxed
    calc = run_tool("calculator", CALC_EXPR, limits)
    assert calc.error is None and calc.output.split(" ≈ ")[0] == str(eval(CALC_EVAL)), calc  # noqa: S307

    rows = {"python tool (sandboxed)": lambda: run_tool("python", PY_CODE, limits),
            "python tool without bubblewrap (before)": lambda: run_python(PY_CODE, _namespaces=False),
            "python in-process (exec)": lambda: _in_process(PY_CODE),
            "bare interpreter start (-I -S -c pass)": _bare_start,
            "calculator tool": lambda: run_tool("calculator", CALC_EXPR, limits),
            "calculator in-process (eval)": lambda: eval(CALC_EVAL)}  # noqa: S307
    pools = {}
    for name, make in ENVS.items():  # one environment turn of --rows episodes, in-process and isolated
        inline, pool = InProcessEnv(make()), EnvPool(make(), workers=workers)
        states, texts = [None] * args.rows, [TURNS[name]] * args.rows
        assert pool.step(states, texts) == inline.step(states, texts)  # the same replies (and the pool started)
        assert all(error is None and reply.tool_call for (reply, _), error in inline.step(states, texts))
        pools[name] = pool
        rows[f"{name} turn in-process"] = lambda e=inline, s=states, t=texts: e.step(s, t)
        rows[f"{name} turn isolated"] = lambda e=pool, s=states, t=texts: e.step(s, t)
    times: dict[str, list[float]] = {name: [] for name in rows}
    cpu: dict[str, list[float]] = {name: [] for name in rows}
    load_before = os.getloadavg()
    for _ in range(args.calls):
        for name, fn in rows.items():
            wall, used = _timed(fn)
            times[name].append(wall)
            cpu[name].append(used)
    load_after = os.getloadavg()
    for pool in pools.values():
        pool.close()
    med = {name: statistics.median(values) for name, values in times.items()}
    med_cpu = {name: statistics.median(values) for name, values in cpu.items()}

    print(f"# {args.calls} calls each, interleaved; wall-clock medians; python {sys.version.split()[0]}; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"# isolation layers: {', '.join(k for k, v in isolation().items() if v)}")
    print("| call | wall ms (median) | wall p10–p90 | CPU ms (median) |")
    print("|---|---:|---:|---:|")
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        print(f"| {name} | {med[name]:.3f} | {q[0]:.3f}–{q[-1]:.3f} | {med_cpu[name]:.3f} |")
    py_over = med["python tool (sandboxed)"] - med["python in-process (exec)"]
    setup = med["python tool (sandboxed)"] - med["bare interpreter start (-I -S -c pass)"]
    before_over = med["python tool without bubblewrap (before)"] - med["python in-process (exec)"]
    calc_over = med["calculator tool"] - med["calculator in-process (eval)"]
    py_cpu = med_cpu["python tool (sandboxed)"] - med_cpu["python in-process (exec)"]
    print(f"\npython tool: isolation overhead {py_over:.1f} ms per call (of it the interpreter's start "
          f"{med['bare interpreter start (-I -S -c pass)']:.1f} ms, the sandbox's set-up and the rest {setup:.1f} ms)")
    print(f"python tool: the kernel layers (bubblewrap, seccomp) cost {py_over - before_over:.1f} ms per call: "
          f"overhead {py_over / max(before_over, 1e-9):.2f}x the sandbox's without them ({before_over:.1f} ms); "
          f"calls per second {1e3 / med['python tool (sandboxed)']:.1f} against "
          f"{1e3 / med['python tool without bubblewrap (before)']:.1f}")
    print(f"python tool: CPU time per call {py_cpu:.1f} ms more than in-process (bare start "
          f"{med_cpu['bare interpreter start (-I -S -c pass)']:.1f} ms)")
    print(f"calculator: overhead {calc_over * 1e3:.0f} µs per call against eval "
          f"({med['calculator tool'] / max(med['calculator in-process (eval)'], 1e-9):.1f}× eval)")
    for name in ENVS:
        inline, isolated = med[f"{name} turn in-process"], med[f"{name} turn isolated"]
        print(f"{name} environment: isolation overhead {isolated - inline:.2f} ms per turn of {args.rows} episodes "
              f"({workers} worker{'s' * (workers > 1)}; in-process {inline:.2f} ms, isolated {isolated:.2f} ms; "
              f"{(isolated - inline) / args.rows * 1e3:.0f} µs per episode)")


if __name__ == "__main__":
    main()
