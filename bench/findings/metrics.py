"""Reading the runs: what the findings take from one RL run's ``metrics.jsonl`` (`rl_summary`),
what ``rltt review`` diagnoses (`review_run`), the mean over seeds with its standard error
(`aggregate`), a difference of two arms' gains in standard errors (`diff_verdict`), and the
number formats the report shares."""

from __future__ import annotations

import math
from pathlib import Path

from bench._rltt_runs import median, read_records  # noqa: F401 - read_records: the findings' reader

from .runner import T, rel


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None and math.isfinite(r[key])]
    return [s for s, _ in pts], [v for _, v in pts]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def rl_summary(run_dir: Path) -> dict:
    """What the findings read from one RL run's metrics.jsonl."""
    records = read_records(run_dir)
    _, solve = series(records, "eval/solve_rate")
    _, exit_eval = series(records, "eval/compute/mean_exit")  # read_metrics renames an older run's eval/exit_step_mean
    train = [r for r in records if r["step"] > 0 and "reward/mean" in r]
    late = train[len(train) // 2:]
    _, kl = series(train, "kl/ref")
    _, grad = series(train, "grad_norm/total")

    def exit_p(rows: list[dict]) -> list[float]:
        return [mean([r[f"exit/p_{t}"] for r in rows if f"exit/p_{t}" in r]) for t in range(1, T + 1)]

    return {
        "solve_start": solve[0] if solve else float("nan"),
        "solve_end": solve[-1] if len(solve) > 1 else float("nan"),
        "gain": solve[-1] - solve[0] if len(solve) > 1 else float("nan"),
        "exit_step_start": exit_eval[0] if exit_eval else float("nan"),
        "exit_step_end": exit_eval[-1] if len(exit_eval) > 1 else float("nan"),
        "train_solve_rate": mean([r["solve_rate"] for r in train if "solve_rate" in r]),
        "uniform_frac": mean([r["groups/uniform_frac"] for r in train if "groups/uniform_frac" in r]),
        "uniform_frac_late": mean([r["groups/uniform_frac"] for r in late if "groups/uniform_frac" in r]),
        "kl_end": kl[-1] if kl else float("nan"),
        "kl_late_median": median(kl[len(kl) // 2:]),
        "grad_norm_median": median(grad),
        "exit_p_first": exit_p(train[:1]),
        "exit_p_last": exit_p(train[-max(1, len(train) // 10):]),
        "step_seconds": median([r["time/step"] for r in train if "time/step" in r]),
        "steps": len(train),
        "series": {k: series(train, k) for k in ("kl/ref", "grad_norm/total", "groups/uniform_frac", "reward/mean",
                                                  "exit/mean_step")},
    }


def review_run(run_dir: Path) -> dict:
    """``rltt review RUN_DIR --no-plots``: its printed summary and the diagnoses that fired."""
    import contextlib
    import io

    from rltt.cli.main import main as rltt_main
    from rltt.telemetry.diagnoses import diagnose
    from rltt.telemetry.series import RunData

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = rltt_main(["review", str(run_dir), "--no-plots"])
    found = diagnose(RunData.load(run_dir))
    return {"command": f"rltt review {rel(run_dir)} --no-plots", "exit": code, "output": buf.getvalue(),
            "diagnoses": [{"id": d.id, "severity": d.severity.value,
                           "evidence": [e.describe() for e in d.evidence], "action": d.action} for d in found]}


def binom_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-12) / n) if n > 0 and math.isfinite(p) else float("nan")


def aggregate(runs: list[dict], n_eval: int) -> dict:
    """Mean over seeds; ``se``: the standard error of the mean final solve rate (binomial over
    all held-out samples of all seeds) — differences between arms of the same seeds start from
    the same evaluation, so the SE of a difference of gains is about sqrt(se_a² + se_b²)."""
    ok = [r for r in runs if r and math.isfinite(r.get("gain", float("nan")))]
    if not ok:
        return {"seeds": 0}
    keys = ("solve_start", "solve_end", "gain", "train_solve_rate", "uniform_frac", "uniform_frac_late", "kl_end",
            "kl_late_median", "grad_norm_median", "exit_step_start", "exit_step_end", "step_seconds")
    agg = {k: mean([r[k] for r in ok]) for k in keys}
    agg["gains"] = [r["gain"] for r in ok]
    agg["exit_p_first"] = [mean([r["exit_p_first"][t] for r in ok]) for t in range(T)]
    agg["exit_p_last"] = [mean([r["exit_p_last"][t] for r in ok]) for t in range(T)]
    agg["seeds"] = len(ok)
    agg["se"] = binom_se(agg["solve_end"], n_eval * len(ok))
    return agg


def diff_verdict(a: dict, b: dict, name_a: str, name_b: str) -> tuple[float, float, str]:
    """(gain a − gain b, its SE, a one-line reading)."""
    if not a.get("seeds") or not b.get("seeds"):
        return float("nan"), float("nan"), "not measured"
    d = a["gain"] - b["gain"]
    se = math.sqrt(a["se"] ** 2 + b["se"] ** 2)
    if d > 2 * se:
        text = f"{name_a} gains more than {name_b}: {pts(d)} ± {100 * se:.1f} points (> 2 SE)"
    elif d < -2 * se:
        text = f"{name_b} gains more than {name_a}: {pts(-d)} ± {100 * se:.1f} points (> 2 SE)"
    else:
        text = f"{name_a} − {name_b}: {pts(d)} ± {100 * se:.1f} points, within 2 SE (not resolved)"
    return d, se, text


def paired_pass1(a: list[Path], b: list[Path], names: tuple[str, str]) -> dict:
    """pass@1 of each side's ``rltt eval --out`` files (a side's files are its seeds, pooled: two-level
    bootstrap over problems and seeds) and the paired difference A − B over the same problems (95 %
    interval, p-value; an error message when the files cannot be paired)."""
    from rltt.errors import RlttError
    from rltt.evaluation.results import compare_object, pool_object

    specs = {name: ",".join(str(f) for f in files if f.is_file()) for name, files in zip(names, (a, b))}
    row: dict = {name: pool_object(spec)["summary"]["pass@1"] for name, spec in specs.items() if spec}
    if all(specs.values()):
        try:
            row["difference"] = compare_object(*specs.values())["difference"]["pass@1"]
        except RlttError as exc:
            row["difference"] = {"error": str(exc)}
    return row


def pts(x: float) -> str:
    return f"{100 * x:+.1f}" if math.isfinite(x) else "n/a"


def fmt(x: float, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"
