"""``rltt review``: turn a run's metrics into a health report with plots and diagnoses.

:func:`review` reads ``RUN_DIR/metrics.jsonl`` (a run still writing is fine), runs the
checks of :mod:`rltt.telemetry.diagnoses`, draws the plots of :mod:`rltt.telemetry.plots`
and writes ``RUN_DIR/review/report.md`` (plots as files next to it) and a self-contained
``report.html`` (plots embedded as base64 PNG). :func:`format_summary` is the terminal
summary; :func:`maybe_review` is the hook a training loop calls every N steps and at the end.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rltt.errors import RlttError
from rltt.telemetry import schema
from rltt.telemetry.diagnoses import Check, Diagnosis, Severity, diagnose, late_window, unchecked
from rltt.telemetry.metrics_file import ISOLATION_FILE
from rltt.telemetry.plots import PLOTS, render_all
from rltt.telemetry.series import RunData

log = logging.getLogger(__name__)

REVIEW_DIR = "review"

#: Metrics shown in the report's summary table (when logged), in this order.
SUMMARY_KEYS = (
    schema.REWARD_MEAN, schema.SOLVE_RATE, schema.GROUPS_UNIFORM_FRAC, schema.KL_REF,
    schema.LOSS_TOTAL, schema.LM_LOSS, schema.GRAD_NORM_TOTAL, schema.POLICY_CLIP_FRAC,
    schema.EXIT_MEAN_STEP, schema.exit_p_key(1), schema.EXIT_COLLAPSE,
    schema.COMPUTE_MEAN_EXIT, schema.COMPUTE_PASSES_PER_TOKEN, schema.COMPUTE_EXIT_ENTROPY, schema.REWARD_COMPUTE,
    schema.THROUGHPUT_GOODPUT,
    schema.MISMATCH_MAX_ABS, schema.CORRECTION_MASKED_FRAC, schema.LENGTH_MEAN, schema.LENGTH_TRUNC_FRAC,
    schema.TIME_STEP, schema.THROUGHPUT_TOKENS_PER_S, schema.MEMORY_PEAK_GB, schema.LR,
)


@dataclass
class Report:
    """The outcome of :func:`review`."""

    run: RunData
    diagnoses: list[Diagnosis]
    unchecked: list[Check]
    out_dir: Path
    plots: dict[str, Path] = field(default_factory=dict)
    compare: RunData | None = None
    compare_diagnoses: list[Diagnosis] = field(default_factory=list)

    @property
    def markdown_path(self) -> Path:
        return self.out_dir / "report.md"

    @property
    def html_path(self) -> Path:
        return self.out_dir / "report.html"

    @property
    def healthy(self) -> bool:
        """True when no warning or critical diagnosis fired."""
        return all(d.severity is Severity.INFO for d in self.diagnoses)

    @property
    def worst(self) -> Severity | None:
        return max((d.severity for d in self.diagnoses), key=lambda s: s.rank, default=None)


# --------------------------------------------------------------------------- entry points


def review(run_dir: str | os.PathLike[str], compare: str | os.PathLike[str] | None = None,
           out_dir: str | os.PathLike[str] | None = None, plots: bool = True) -> Report:
    """Review the run in ``run_dir``; write ``report.md`` / ``report.html`` into ``out_dir``.

    ``out_dir`` defaults to ``RUN_DIR/review``. ``compare``: another run directory, overlaid
    on the plots and summarised next to this one. ``plots=False`` skips the figures (the
    diagnoses and both reports are still written). Raises :class:`rltt.errors.RlttError`
    naming the path when a run directory or its metrics.jsonl is missing, or when the file
    holds no record yet.
    """
    run = _load(run_dir)
    other = _load(compare) if compare is not None else None
    if other is not None and other.name == run.name:
        other.name = f"{other.name} (compare)"
    out = Path(out_dir) if out_dir is not None else run.path / REVIEW_DIR
    out.mkdir(parents=True, exist_ok=True)
    report = Report(run=run, diagnoses=diagnose(run), unchecked=unchecked(run), out_dir=out,
                    compare=other, compare_diagnoses=diagnose(other) if other else [])
    if plots:
        runs = [run] + ([other] if other else [])
        report.plots = render_all(runs, out / "plots")
    report.markdown_path.write_text(to_markdown(report), encoding="utf-8")
    report.html_path.write_text(to_html(report), encoding="utf-8")
    return report


def _load(path: str | os.PathLike[str]) -> RunData:
    run = RunData.load(path)
    if not len(run):
        raise RlttError(f"no metric records yet in {run.path / 'metrics.jsonl'}")
    return run


def maybe_review(run_dir: str | os.PathLike[str], step: int, every: int, *,
                 final: bool = False, out_dir: str | os.PathLike[str] | None = None,
                 plots: bool = True) -> Report | None:
    """The training loop's hook: review when ``final`` or when ``step`` is a multiple of
    ``every`` (``every <= 0`` = only at the end).

    Never raises — a failed review must not stop training; the failure is logged as a
    warning and None returned. Diagnoses of warning or critical severity are logged too.
    """
    if not final and (every <= 0 or step % every != 0):
        return None
    try:
        report = review(run_dir, out_dir=out_dir, plots=plots)
    except Exception as exc:  # noqa: BLE001 - telemetry must not kill the run
        log.warning("rltt review of %s at step %d failed: %s", run_dir, step, exc)
        return None
    for d in report.diagnoses:
        if d.severity is not Severity.INFO:
            log.warning("review at step %d: [%s] %s — %s", step, d.severity.value, d.title,
                        d.action)
    return report


# --------------------------------------------------------------------------- text


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    if not math.isfinite(value):
        return str(value)
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def _span_text(run: RunData) -> str:
    span = run.step_range
    text = f"steps {span[0]}–{span[1]}, {len(run)} records" if span else "no records"
    if run.truncated_tail:
        text += "; last line incomplete (run still writing?)"
    other_bad = run.bad_lines[:-1] if run.truncated_tail else run.bad_lines
    if other_bad:
        text += f"; {len(other_bad)} unreadable line(s) skipped"
    return text


def summary_rows(run: RunData, other: RunData | None = None) -> list[tuple[str, ...]]:
    """(key, first, last, late-window mean[, other's last]) for the logged SUMMARY_KEYS."""
    keys = list(SUMMARY_KEYS)
    entropy = run.indexed(schema.ENTROPY_LOOP)
    if entropy:
        keys.insert(keys.index(schema.EXIT_MEAN_STEP), entropy[max(entropy)])
    lora = lora_keys(run) + (lora_keys(other) if other is not None else [])
    at = keys.index(schema.GRAD_NORM_TOTAL) + 1  # a LoRA run's adapters, group by group
    keys[at:at] = list(dict.fromkeys(lora))
    rows = []
    for key in keys:
        if not run.has(key) and not (other and other.has(key)):
            continue
        steps, values = run.series(key)
        if len(values):
            _, late = late_window(steps, values)
            row = (key, _fmt(values[0]), _fmt(values[-1]), _fmt(float(np.mean(late))))
        else:
            row = (key, "–", "–", "–")
        if other is not None:
            row += (_fmt(other.last(key)),)
        rows.append(row)
    return rows


def lora_keys(run: RunData) -> list[str]:
    """A LoRA run's ``lora/update_norm/<group>`` and ``lora/B_norm/<group>`` keys, by group."""
    updates, bs = run.named(schema.LORA_UPDATE_NORM), run.named(schema.LORA_B_NORM)
    return [key for group in sorted(set(updates) | set(bs)) for key in (updates.get(group), bs.get(group)) if key]


def _verdict_line(report: Report) -> str:
    if not report.diagnoses:
        return "healthy: no diagnosis fired"
    counts = {}
    for d in report.diagnoses:
        counts[d.severity.value] = counts.get(d.severity.value, 0) + 1
    parts = [f"{counts[s]} {s}" for s in ("critical", "warning", "info") if s in counts]
    return "problems found: " + ", ".join(parts)


def format_summary(report: Report) -> str:
    """A short terminal summary: the run, key numbers, the verdict and where the report is."""
    run = report.run
    lines = [f"rltt review: {run.path} ({_span_text(run)})"]
    latest = [f"{key} {_fmt(run.last(key))}" for key in SUMMARY_KEYS[:8] if run.has(key)]
    if latest:
        lines.append("  latest: " + ", ".join(latest))
    lines.append(f"verdict: {_verdict_line(report)}")
    isolation = isolation_line(run.path)
    if isolation:
        lines.append(f"  {isolation}")
    for d in report.diagnoses:
        lines.append(f"  [{d.severity.value}] {d.title} ({d.id})")
        for e in d.evidence:
            lines.append(f"      {e.describe()}")
        lines.append(f"      → {d.action}")
    if report.unchecked:
        lines.append("  not checked (metrics not logged): "
                     + ", ".join(c.id for c in report.unchecked))
    if report.compare is not None:
        lines.append(f"compare: {report.compare.path} ({_span_text(report.compare)}): "
                     f"{len(report.compare_diagnoses)} diagnosis(es)"
                     + "".join(f"\n  [{d.severity.value}] {d.title} ({d.id})"
                               for d in report.compare_diagnoses))
    lines.append(f"report: {report.html_path}")
    return "\n".join(lines)


def isolation_line(run_path: Path) -> str | None:
    """What ``RUN_DIR/isolation.json`` (written by a run with the python tool) says: the layers
    that applied and those that did not; None without the file."""
    path = Path(run_path) / ISOLATION_FILE
    try:
        layers = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(layers, dict):
        return None
    on = [k for k, v in layers.items() if v and k != "unconfined_opt_out"]
    off = [k for k, v in layers.items() if not v and k != "unconfined_opt_out"]
    note = " — UNCONFINED (env.python.unconfined: true)" if layers.get("unconfined_opt_out") else ""
    return (f"python tool isolation{note}: {', '.join(on) or 'none'}"
            + (f"; missing: {', '.join(off)}" if off else ""))


# --------------------------------------------------------------------------- markdown


def to_markdown(report: Report) -> str:
    """The report as Markdown (plots referenced as files under ``plots/``)."""
    run, other = report.run, report.compare
    out = [f"# Run review: {run.name}", "", f"- run: `{run.path}` ({_span_text(run)})"]
    if other is not None:
        out.append(f"- compared with: `{other.path}` ({_span_text(other)})")
    out += ["", "## Verdict", "", f"**{_verdict_line(report)}**", ""]
    isolation = isolation_line(run.path)
    if isolation:
        out += [f"- {isolation}", ""]
    for d in report.diagnoses:
        out.append(f"### [{d.severity.value}] {d.title} (`{d.id}`)")
        out.append("")
        if d.detail:
            out += [d.detail, ""]
        out += [f"- evidence: {e.describe()}" for e in d.evidence]
        out += [f"- **action**: {d.action}", ""]
    if report.unchecked:
        out += ["Not checked (metrics not logged): "
                + ", ".join(f"`{c.id}`" for c in report.unchecked), ""]
    if other is not None:
        verdict = (f"{len(report.compare_diagnoses)} diagnosis(es)" if report.compare_diagnoses
                   else "healthy, no diagnosis fired")
        out += [f"### Compared run `{other.name}`: {verdict}", ""]
        out += [f"- [{d.severity.value}] {d.title} (`{d.id}`)" for d in report.compare_diagnoses]
        out.append("")
    rows = summary_rows(run, other)
    if rows:
        header = ["metric", "first", "last", "late mean"] + ([f"last [{other.name}]"]
                                                              if other else [])
        out += ["## Summary", "", "| " + " | ".join(header) + " |",
                "|" + "---|" * len(header)]
        out += ["| " + " | ".join((f"`{r[0]}`",) + r[1:]) + " |" for r in rows]
        out.append("")
    if report.plots:
        out += ["## Plots", ""]
        titles = {p.name: p.title for p in PLOTS}
        for name, path in report.plots.items():
            rel = os.path.relpath(path, report.out_dir)
            out += [f"### {titles.get(name, name)}", "", f"![{name}]({rel})", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- html

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em}
.diag{border-left:5px solid #999;padding:.4em .8em;margin:.8em 0;background:#fafafa}
.critical{border-color:#c0392b}.warning{border-color:#e67e22}.info{border-color:#2980b9}
.sev{font-weight:bold;text-transform:uppercase;font-size:.8em}
.healthy{color:#27ae60;font-weight:bold}.problems{color:#c0392b;font-weight:bold}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;padding:.2em .6em}
td:not(:first-child){text-align:right;font-family:monospace}
img{max-width:100%;border:1px solid #eee;margin:.4em 0}code{background:#f2f2f2;padding:0 .2em}
"""


def to_html(report: Report) -> str:
    """The report as one self-contained HTML page: inline CSS, plots as data: URIs."""
    e = html.escape
    run, other = report.run, report.compare
    body = [f"<h1>Run review: {e(run.name)}</h1>",
            f"<p>run: <code>{e(str(run.path))}</code> ({e(_span_text(run))})"]
    if other is not None:
        body.append(f"<br>compared with: <code>{e(str(other.path))}</code> "
                    f"({e(_span_text(other))})")
    body.append("</p><h2>Verdict</h2>")
    css = "healthy" if not report.diagnoses else "problems"
    body.append(f'<p class="{css}">{e(_verdict_line(report))}</p>')
    for d in report.diagnoses:
        items = "".join(f"<li>{e(ev.describe())}</li>" for ev in d.evidence)
        body.append(
            f'<div class="diag {d.severity.value}"><span class="sev">{d.severity.value}</span> '
            f"<b>{e(d.title)}</b> <code>{e(d.id)}</code>"
            + (f"<p>{e(d.detail)}</p>" if d.detail else "")
            + f"<ul>{items}</ul><p><b>Action:</b> {e(d.action)}</p></div>")
    if report.unchecked:
        body.append("<p>Not checked (metrics not logged): "
                    + ", ".join(f"<code>{e(c.id)}</code>" for c in report.unchecked) + "</p>")
    if other is not None:
        items = "".join(f"<li>[{d.severity.value}] {e(d.title)} <code>{e(d.id)}</code></li>"
                        for d in report.compare_diagnoses)
        body.append(f"<h3>Compared run {e(other.name)}: {len(report.compare_diagnoses)} "
                    f"diagnosis(es)</h3><ul>{items}</ul>")
    rows = summary_rows(run, other)
    if rows:
        header = ["metric", "first", "last", "late mean"] + ([f"last [{other.name}]"]
                                                              if other else [])
        body.append("<h2>Summary</h2><table><tr>"
                    + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
        for r in rows:
            body.append("<tr>" + f"<td><code>{e(r[0])}</code></td>"
                        + "".join(f"<td>{e(c)}</td>" for c in r[1:]) + "</tr>")
        body.append("</table>")
    if report.plots:
        body.append("<h2>Plots</h2>")
        titles = {p.name: p.title for p in PLOTS}
        for name, path in report.plots.items():
            data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
            body.append(f"<h3>{e(titles.get(name, name))}</h3>"
                        f'<img alt="{e(name)}" src="data:image/png;base64,{data}">')
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>rltt review: {e(run.name)}</title><style>{_CSS}</style></head>"
            "<body>\n" + "\n".join(body) + "\n</body></html>\n")
