"""The check's report: figures, section results, time budgets and guards, and its JSON and Markdown."""

from __future__ import annotations

import json
import math
import signal
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1024 ** 3  # rltt.telemetry.schema.GIB's value: the check imports rltt only inside its sections (a failed import is a figure)

@dataclass
class Figure:
    name: str
    value: object
    unit: str = ""
    setting: str = ""


@dataclass
class SectionResult:
    name: str
    budget_s: float
    status: str = "not run"  # ok | partial (sub-steps skipped for time) | error (the section or a sub-step failed)
    #                          | absent (what it checks is not installed: a note, not a failure)
    seconds: float = 0.0
    error: str | None = None
    skipped: list = field(default_factory=list)
    failures: list = field(default_factory=list)  # sub-steps that failed while the section went on
    figures: list = field(default_factory=list)
    absent: str | None = None  # why the section had nothing to check (e.g. vLLM not installed)

    def add(self, name: str, value, unit: str = "", setting: str = "") -> None:
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)  # JSON has no inf/nan
        self.figures.append(Figure(name, value, unit, setting))

    def skip(self, what: str) -> None:
        self.skipped.append(what)

    current = None  # the sub-step running now (not fields: not in the JSON)
    cut_in = None  # the sub-step a time-out or SIGTERM ended

    def log(self, what: str) -> None:
        log(f"{self.name}: {what}")

    @contextmanager
    def step(self, what: str):
        """One sub-step: its start and elapsed time go to the log; an exception is recorded as a failure
        and the section goes on (the section's time-out, a BaseException, still ends it)."""
        start, outer = time.perf_counter(), self.current
        self.current = what
        self.log(f"{what}: start")
        try:
            yield
            self.log(f"{what}: done in {time.perf_counter() - start:.1f} s")
        except Exception as exc:  # noqa: BLE001 - recorded (one line: a Triton compile error spans many)
            self.failures.append(" ".join(f"{what}: {type(exc).__name__}: {exc}".split())[:1000])
            print(f"[gpu_check] {self.name}: {what} FAILED after {time.perf_counter() - start:.1f} s\n"
                  f"{traceback.format_exc()}", flush=True)
        except BaseException:  # the section's alarm or SIGTERM: name the innermost sub-step it cut
            self.cut_in = self.cut_in or what
            self.log(f"{what}: cut after {time.perf_counter() - start:.1f} s")
            raise
        finally:
            self.current = outer


_T0 = time.monotonic()


def log(message: str) -> None:
    """One line of the log with the seconds since the start, flushed (a killed run shows where it was)."""
    print(f"[gpu_check {time.monotonic() - _T0:6.1f}s] {message}", flush=True)


class SectionTimeout(BaseException):
    """Raised by the section alarm (a BaseException, so library code catching Exception lets it pass)."""


class Terminated(BaseException):
    """Raised by SIGTERM (the outer ``timeout``): the run writes what it measured and exits."""


def on_sigterm(signum, frame):
    raise Terminated("SIGTERM (the outer timeout?)")


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, estimate: float) -> bool:
        return self.left() > estimate


@contextmanager
def alarm(seconds: float, name: str):
    """Hard limit of one section: SIGALRM raises SectionTimeout between Python bytecodes."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise SectionTimeout(f"section {name!r} ran past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    start = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:  # an alarm set by the caller (e.g. a test timeout) keeps running
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


def run_section(name: str, fn, ctx) -> SectionResult:
    """Run one section under its budget (``ctx``: a `context.Context`). The allocator's peak is reset first,
    so a peak the section reads (its own or `rltt train`'s first step's) is never an earlier section's."""
    budget = ctx.shapes.budgets[name] * ctx.budget_scale
    result = SectionResult(name, budget)
    ctx.running = result
    reset = getattr(ctx, "reset_peak", None)
    if reset is not None:
        reset()
    start = time.perf_counter()
    log(f"{name}: start (budget {budget:.0f} s)")
    try:
        with alarm(budget, name):
            fn(ctx, result, Deadline(budget))
        result.status = ("error" if result.failures else "partial" if result.skipped else
                         "absent" if result.absent else "ok")
    except (Exception, SectionTimeout, Terminated) as exc:  # noqa: BLE001 - recorded; the other sections still run
        result.status = "error"
        where = f" (in sub-step {result.cut_in!r})" if result.cut_in else ""
        result.failures.append(f"{type(exc).__name__}{where}: {exc}".strip()[:2000])
        print(f"[gpu_check] {name}: ERROR\n{traceback.format_exc()}", flush=True)
        if isinstance(exc, Terminated):
            result.error = " | ".join(result.failures)
            result.seconds = round(time.perf_counter() - start, 2)
            raise
    finally:
        result.error = " | ".join(result.failures) or None
        result.seconds = round(time.perf_counter() - start, 2)
        ctx.release()
    log(f"{name}: {result.status} in {result.seconds:.1f} s")
    return result




def take_worker_result(sec: SectionResult, section: str, result: dict) -> bool:
    """A section worker's result file as this section's: ``absent`` with its note (False), or its
    figures, failures and skipped sub-steps (True)."""
    if "absent" in result:
        sec.absent = result["absent"]
        print(f"[gpu_check] {section}: {sec.absent}", flush=True)
        return False
    for f in result["figures"]:
        sec.add(f["name"], f["value"], f["unit"], f["setting"])
    sec.failures += result["failures"]
    sec.skipped += result.get("skipped", [])
    return True



# -- output -------------------------------------------------------------------------------------------
def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def markdown(report: dict) -> str:
    """The report as Markdown: a header (command, GPU, versions), one status row per section, then
    each section's figures, grouped under the setting they were measured in."""
    env = report["env"]
    gpu = env.get("gpu")
    if env.get("gpu_sms"):
        gpu += f" ({env['gpu_memory_gib']} GiB, compute capability {env['gpu_capability']}, {env['gpu_sms']} SMs)"
    lines = [f"# GPU check ({env['mode']})", "",
             f"Command: `{report['command']}`", "",
             f"- GPU: {gpu}",
             f"- torch {env['torch']} (CUDA {env['torch_cuda']}), triton {env['triton']}, transformers "
             f"{env['transformers']}, tokenizers {env['tokenizers']}, Python {env['python']}",
             f"- rltt {env['rltt_commit']}; Triton interpreter: {env['triton_interpret'] or 'off'}; "
             f"deepspeed/ray/vllm modules loaded: {len(env.get('heavy_modules_loaded', []))}",
             f"- total {report['total_s']:.1f} s", "",
             "| section | status | seconds | budget s | error / skipped |", "|---|---|---:|---:|---|"]
    for sec in report["sections"].values():
        note = (sec["error"] or "; ".join(f"skipped: {s}" for s in sec["skipped"]) or sec.get("absent") or ""
                ).replace("|", "/")
        lines.append(f"| {sec['name']} | {sec['status']} | {sec['seconds']:.1f} | {sec['budget_s']:.0f} | {note} |")
    for sec in report["sections"].values():
        lines += ["", f"## {sec['name']}"]
        setting = None
        for f in sec["figures"]:
            if f["setting"] != setting:
                setting = f["setting"]
                lines += ["", f"Setting: {setting}", "", "| figure | value | unit |", "|---|---:|---|"]
            lines.append(f"| {f['name']} | {_fmt(f['value'])} | {f['unit'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))

