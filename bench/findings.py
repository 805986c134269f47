"""RL findings at small scale: solve-rate band, learning rate, dense twin, per-loop credit.

Tests four findings reported for RL on looped models (the "Reported" lines below: figures
from other runs, not measured here; bench/RESULTS.md says which hold at this scale) with real
``rltt curate`` / ``rltt train`` / ``rltt pretrain`` runs of the shipped recipes
(``recipes/quickstart.yaml``, ``recipes/pretrain-tiny.yaml``) on the quickstart model and the
synthetic task:

1. **Solve-rate band**: the same RL budget on prompts curated into a low (~0.1), mixed
   (~0.3-0.5) and high (~0.8) solve-rate band. The pool mixes the synthetic difficulty presets;
   ``rltt curate --band`` splits it by each prompt's measured solve rate. Held-out gain and the
   share of uniform groups (zero advantage) per band. Reported: +12 points at s ~ 0.30, none at
   s ~ 0.77, where the groups are uniform.
2. **Learning rate**: lr 1e-6 / 1e-5 / 1e-4 / 1e-3 at equal steps: KL to the reference, grad
   norm, held-out gain, and what ``rltt review`` diagnoses for each run. Reported: lr 1e-6
   left KL at ~2e-4 (the policy did not move), 1e-5 worked.
3. **Dense twin**: ``recipes/pretrain-tiny.yaml`` at T = 4 and at T = 1 (the same block, so the
   same parameters, and the same data): held-out LM loss and solve rate, then equal RL steps on
   each. Reported: recurrence beats a parameter-matched dense model at equal data.
4. **Per-loop credit**: ``algorithm.policy_logprob`` = exit / final / rltt (omega exit_pdf and
   progressive) at equal steps and seeds, with sampled exits (``rollout.exit_policy=sample``;
   under the quickstart's own ``final`` exits, exit and final are the same log-prob): held-out
   gain and exit distribution after RL. Reported: RLTT's credit beats final-loop GRPO.

    python bench/findings.py [--out runs/bench-findings] [--smoke] [--jobs 2] [--only band,lr,dense,credit]
    rltt bench findings --smoke --out /tmp/findings

Every arm is a subprocess (one CPU thread each), ``--jobs`` of them at a time. Writes
``OUT/findings.json``, ``OUT/findings.md`` (a Markdown section per finding, with the exact
commands), ``OUT/<finding>.png``, the run directories under ``OUT/runs`` and one log per arm
under ``OUT/logs``. The full mode (40 RL steps per arm; two seeds for the per-loop credit arms,
one for the others) took 33 minutes on 2 CPU cores shared with other jobs (load 4-8); ``--smoke``
(one seed, a few steps per arm, tiny evaluations and pretraining) checks that every arm runs in a
few minutes. ``--resume`` continues an interrupted run; ``--report-only`` rebuilds the outputs. The full mode reuses the cached quickstart model (built by
``rltt.lm_training.quickstart_model`` from ``recipes/pretrain-tiny.yaml``) as the T = 4 pretraining arm;
``--retrain-t4`` runs that pretraining again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RL_RECIPE = "recipes/quickstart.yaml"
PRETRAIN_RECIPE = "recipes/pretrain-tiny.yaml"
FINDINGS = ("band", "lr", "dense", "credit")
SECTION = "## RL findings at small scale (bench/findings.py)"

#: kept solve-rate windows (inclusive) of the three bands
BANDS = {"low": (0.0, 0.2), "mixed": (0.25, 0.6), "high": (0.7, 1.0)}
#: the synthetic difficulty presets the band pool is drawn from
POOL_PRESETS = ("trivial", "easy", "quickstart", "medium")
LRS = (1e-6, 1e-5, 1e-4, 1e-3)
#: per-loop credit arms: name -> algorithm overrides
CREDIT = {
    "exit": ["algorithm.policy_logprob=exit"],
    "final": ["algorithm.policy_logprob=final"],
    "rltt-exit_pdf": ["algorithm.policy_logprob=rltt", "algorithm.omega=exit_pdf"],
    "rltt-progressive": ["algorithm.policy_logprob=rltt", "algorithm.omega=progressive"],
}
CREDIT_ROLLOUT = ["rollout.exit_policy=sample"]
T = 4
NAN = float("nan")


@dataclass(frozen=True)
class Scale:
    """How big each arm is."""

    seeds: int  # seeds of the band arms
    credit_seeds: int
    rl_steps: int  # RL steps of the band, dense and credit arms
    lr_steps: int  # RL steps of the learning-rate arms
    lr_seeds: int
    dense_seeds: int
    eval_size: int  # held-out problems of every RL evaluation ...
    eval_samples: int  # ... x samples each
    pool_per_preset: int  # band pool: prompts per difficulty preset
    curate_samples: int  # completions per prompt when curating
    pretrain: tuple[str, ...] = ()  # overrides of both pretraining arms
    reuse_t4: bool = True  # the T = 4 arm is the cached quickstart model


FULL = Scale(seeds=1, credit_seeds=2, rl_steps=40, lr_steps=40, lr_seeds=1, dense_seeds=1, eval_size=256, eval_samples=2,
             pool_per_preset=128, curate_samples=16)
SMOKE = Scale(seeds=1, credit_seeds=1, rl_steps=3, lr_steps=3, lr_seeds=1, dense_seeds=1, eval_size=8, eval_samples=1,
              pool_per_preset=8, curate_samples=4, reuse_t4=False,
              pretrain=("train.steps=4", "train.batch_size=4", "eval.every=4", "eval.loss_batches=1",
                        "eval.solve_problems=4", "eval.max_new_tokens=16", "data.held_out_docs=8",
                        "tokenizer.train_docs=200", "checkpoint.every=0", "logging.every=1"))


# --------------------------------------------------------------------------- arms and their scheduler


@dataclass
class Arm:
    """One unit of work: a CLI command (``argv`` after ``rltt``) or an in-process function."""

    name: str
    argv: list[str] | None = None
    fn: Callable[[], None] | None = None
    describe: str = ""  # what an in-process arm does
    deps: tuple[str, ...] = ()
    cost: float = 1.0  # relative estimate, orders the queue (critical path first)
    run_dir: Path | None = None
    status: str = "pending"  # pending | running | done | failed | skipped
    seconds: float = 0.0
    error: str = ""

    @property
    def command(self) -> str:
        return "rltt " + " ".join(shlex.quote(a) for a in self.argv) if self.argv else f"# {self.describe}"


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    # one thread per arm: OpenMP threads stall when other processes share the cores
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_arms(arms: dict[str, Arm], logs: Path, jobs: int) -> None:
    """Run every arm once its dependencies are done, ``jobs`` at a time (longest chain first); an
    arm whose dependency failed is skipped."""
    logs.mkdir(parents=True, exist_ok=True)
    dependents: dict[str, list[str]] = {n: [] for n in arms}
    for arm in arms.values():
        for d in arm.deps:
            dependents[d].append(arm.name)
    chain: dict[str, float] = {}

    def chain_cost(name: str) -> float:  # the arm's cost plus its longest chain of dependents
        if name not in chain:
            chain[name] = arms[name].cost + max((chain_cost(d) for d in dependents[name]), default=0.0)
        return chain[name]

    lock = threading.Condition()
    env = child_env()
    total, finished = len(arms), [0]
    start = time.perf_counter()

    def work(arm: Arm) -> None:
        t0 = time.perf_counter()
        try:
            if arm.argv is not None:
                with (logs / f"{arm.name}.log").open("w") as log:
                    log.write(arm.command + "\n\n")
                    log.flush()
                    code = subprocess.call([sys.executable, "-m", "rltt.cli.main", *arm.argv], cwd=ROOT, env=env,
                                           stdout=log, stderr=subprocess.STDOUT)
                if code:
                    tail = (logs / f"{arm.name}.log").read_text(errors="replace").strip().splitlines()[-3:]
                    raise RuntimeError(f"exit status {code}: " + " | ".join(tail))
            else:
                arm.fn()
            status, error = "done", ""
        except Exception as exc:  # noqa: BLE001 - reported per arm, dependents skipped
            status, error = "failed", f"{type(exc).__name__}: {exc}"
        with lock:
            arm.status, arm.error, arm.seconds = status, error, time.perf_counter() - t0
            finished[0] += 1
            print(f"[{finished[0]:2d}/{total}] {arm.name}: {status} in {arm.seconds:.0f}s "
                  f"(t = {time.perf_counter() - start:.0f}s){'  ' + error if error else ''}", file=sys.stderr,
                  flush=True)
            lock.notify_all()

    with lock:
        while True:
            for arm in arms.values():  # skip what can no longer run
                if arm.status == "pending" and any(arms[d].status in ("failed", "skipped") for d in arm.deps):
                    arm.status, arm.error = "skipped", "a dependency failed"
                    finished[0] += 1
            running = sum(a.status == "running" for a in arms.values())
            ready = sorted((a for a in arms.values() if a.status == "pending"
                            and all(arms[d].status == "done" for d in a.deps)), key=lambda a: -chain_cost(a.name))
            for arm in ready[:max(0, jobs - running)]:
                arm.status = "running"
                threading.Thread(target=work, args=(arm,), daemon=True).start()
                running += 1
            if running == 0 and not ready:
                break
            lock.wait()


# --------------------------------------------------------------------------- the arms of each finding


def train_argv(scale: Scale, run_dir: Path, seed: int, steps: int, extra: list[str]) -> list[str]:
    return ["train", RL_RECIPE, *extra, f"seed={seed}", f"train.steps={steps}", f"train.eval_every={steps}",
            f"data.eval_size={scale.eval_size}", f"train.eval_samples={scale.eval_samples}", "train.threads=1",
            f"logging.run_dir={rel(run_dir)}", "logging.progress=false", "logging.review_at_end=false",
            "checkpoint.every=0", "checkpoint.save_final=false"]


def rel(path: Path) -> str:
    """``path`` relative to the repository root when it is inside it (shorter commands)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def write_pool(path: Path, per_preset: int) -> dict[str, int]:
    """The band pool: ``per_preset`` problems of each difficulty preset as one GSM8K file (ids
    ``PRESET-i``, unique across presets)."""
    from rltt.data import synthetic

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for preset in POOL_PRESETS:
            for i, record in enumerate(synthetic.generate(per_preset, preset, seed=0)):
                f.write(json.dumps({**record, "id": f"{preset}-{i}"}) + "\n")
    return {p: per_preset for p in POOL_PRESETS}


def band_arms(out: Path, scale: Scale) -> dict[str, Arm]:
    d = out / "band"
    pool, records = d / "pool.jsonl", d / "pool.curated.jsonl"
    arms = {"band-pool": Arm("band-pool", fn=lambda: write_pool(pool, scale.pool_per_preset), cost=0.1,
                             describe=f"{rel(pool)}: {scale.pool_per_preset} problems of each preset "
                                      f"{', '.join(POOL_PRESETS)} (rltt.data.synthetic.generate, seed 0; "
                                      "ids PRESET-i), one GSM8K-format JSONL")}
    previous = "band-pool"
    for band, (lo, hi) in BANDS.items():
        # the first call samples the pool; the next resume its records and write their own band
        name = f"band-curate-{band}"
        arms[name] = Arm(name, ["curate", RL_RECIPE, "train.threads=1", "--source", rel(pool), "--samples",
                                str(scale.curate_samples), "--band", f"{lo},{hi}", "--out", rel(records),
                                "--kept", rel(d / f"{band}.jsonl"), "--no-progress"],
                         deps=(previous,), cost=8.0 if band == "low" else 0.5)
        previous = name
    for band in BANDS:
        for seed in range(scale.seeds):
            name = f"band-{band}-s{seed}"
            run = out / "runs" / name
            arms[name] = Arm(name, train_argv(scale, run, seed, scale.rl_steps,
                                              [f"data.source={rel(d / f'{band}.jsonl')}",
                                               "data.eval_source=synthetic:quickstart"]),
                             deps=(f"band-curate-{band}",), cost=scale.rl_steps / 60 * 4, run_dir=run)
    return arms


def lr_arms(out: Path, scale: Scale) -> dict[str, Arm]:
    arms = {}
    for lr in LRS:
        for seed in range(scale.lr_seeds):
            name = f"lr-{lr:.0e}-s{seed}"
            run = out / "runs" / name
            arms[name] = Arm(name, train_argv(scale, run, seed, scale.lr_steps, [f"learner.lr={lr:g}"]),
                             cost=scale.lr_steps / 60 * 4, run_dir=run)
    return arms


def reuse_quickstart_model(info: dict) -> Callable[[], None]:
    """The T = 4 pretraining arm from the cache: ``recipes/pretrain-tiny.yaml`` as
    `rltt.lm_training.quickstart_model` runs it (built now when the cache holds no model of this recipe)."""

    def fn() -> None:
        import torch

        from rltt.lm_training.quickstart_model import ensure_quickstart_model, quickstart_info

        torch.set_num_threads(1)
        model = ensure_quickstart_model(progress=False)
        info.update(quickstart_info() or {}, model=str(model))

    return fn


def dense_arms(out: Path, scale: Scale, retrain_t4: bool, t4_info: dict) -> dict[str, Arm]:
    arms = {}
    for loops in (T, 1):
        name = f"dense-pretrain-T{loops}"
        run = out / "runs" / name
        if loops == T and scale.reuse_t4 and not retrain_t4:
            arms[name] = Arm(name, fn=reuse_quickstart_model(t4_info), cost=0.5,
                             describe=f"T = {T}: the cached quickstart model, rltt.lm_training.quickstart_model."
                                      f"ensure_quickstart_model() = `rltt pretrain {PRETRAIN_RECIPE}` "
                                      "(built now if not cached)")
        else:
            arms[name] = Arm(name, ["pretrain", PRETRAIN_RECIPE, f"model.config.num_loops={loops}",
                                    f"logging.run_dir={rel(run)}", "logging.progress=false", *scale.pretrain],
                             cost=(10.0 if loops == T else 3.0) if not scale.pretrain else 1.0, run_dir=run)
        for seed in range(scale.dense_seeds):
            rl = f"dense-rl-T{loops}-s{seed}"
            model = "quickstart" if arms[name].argv is None else rel(run / "final")
            arms[rl] = Arm(rl, train_argv(scale, out / "runs" / rl, seed, scale.rl_steps, [f"model.path={model}"]),
                           deps=(name,), cost=scale.rl_steps / 60 * (4 if loops == T else 2),
                           run_dir=out / "runs" / rl)
    return arms


def credit_arms(out: Path, scale: Scale) -> dict[str, Arm]:
    arms = {}
    for kind, overrides in CREDIT.items():
        for seed in range(scale.credit_seeds):
            name = f"credit-{kind}-s{seed}"
            run = out / "runs" / name
            arms[name] = Arm(name, train_argv(scale, run, seed, scale.rl_steps, [*CREDIT_ROLLOUT, *overrides]),
                             cost=scale.rl_steps / 60 * (5 if kind.startswith("rltt") else 4), run_dir=run)
    return arms


# --------------------------------------------------------------------------- reading the runs


def read_records(run_dir: Path) -> list[dict]:
    from rltt.telemetry import read_metrics

    return read_metrics(run_dir)


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None and math.isfinite(r[key])]
    return [s for s, _ in pts], [v for _, v in pts]


def median(values: list[float]) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def rl_summary(run_dir: Path) -> dict:
    """What the findings read from one RL run's metrics.jsonl."""
    records = read_records(run_dir)
    _, solve = series(records, "eval/solve_rate")
    _, exit_eval = series(records, "eval/exit_step_mean")
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


def pts(x: float) -> str:
    return f"{100 * x:+.1f}" if math.isfinite(x) else "n/a"


def fmt(x: float, spec: str = ".3f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


# --------------------------------------------------------------------------- findings: results


def band_results(out: Path, arms: dict[str, Arm], scale: Scale) -> dict:
    d = out / "band"
    n_eval = scale.eval_size * scale.eval_samples
    res = {"bands": {}, "pool": {}}
    records = []
    if (d / "pool.curated.jsonl").is_file():
        records = [json.loads(line) for line in (d / "pool.curated.jsonl").read_text().splitlines() if line.strip()]
    for preset in POOL_PRESETS:
        rates = [r["solve_rate"] for r in records if r["id"].startswith(preset + "-")]
        res["pool"][preset] = {"prompts": len(rates), "mean_solve_rate": mean(rates)}
    res["pool_rates"] = [r["solve_rate"] for r in records]
    for band, (lo, hi) in BANDS.items():
        kept = [json.loads(line) for line in (d / f"{band}.jsonl").read_text().splitlines()
                if line.strip()] if (d / f"{band}.jsonl").is_file() else []
        runs = [rl_summary(a.run_dir) for a in arms.values()
                if a.name.startswith(f"band-{band}-s") and a.status == "done"]
        res["bands"][band] = {
            "window": [lo, hi], "prompts": len(kept), "curated_solve_rate": mean([r["solve_rate"] for r in kept]),
            "by_preset": {p: sum(r["id"].startswith(p + "-") for r in kept) for p in POOL_PRESETS},
            "runs": runs, **aggregate(runs, n_eval)}
    b = res["bands"]
    res["mixed_vs_high"] = diff_verdict(b["mixed"], b["high"], "mixed", "high")
    res["mixed_vs_low"] = diff_verdict(b["mixed"], b["low"], "mixed", "low")
    return res


def lr_results(arms: dict[str, Arm], scale: Scale) -> dict:
    n_eval = scale.eval_size * scale.eval_samples
    res = {}
    for lr in LRS:
        done = [a for a in arms.values() if a.name.startswith(f"lr-{lr:.0e}-s") and a.status == "done"]
        runs = [rl_summary(a.run_dir) for a in done]
        reviews = [review_run(a.run_dir) for a in done]
        res[f"{lr:g}"] = {"lr": lr, "runs": runs, "reviews": reviews, **aggregate(runs, n_eval)}
    return res


def pretrain_summary(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_records(run_dir)
    steps, loss = series(records, "lm/loss")
    ev = summary.get("eval", {})
    return {"lm_loss": ev.get("eval/lm_loss"), "lm_loss_per_loop": [ev.get(f"eval/lm_loss_step_{t}")
                                                                    for t in range(1, T + 1)],
            "solve_rate": ev.get("eval/solve_rate"), "exit_p": [ev.get(f"eval/exit/p_{t}") for t in range(1, T + 1)],
            "steps": summary.get("step"), "tokens": summary.get("tokens"),
            "train_seconds": summary.get("train_seconds"), "loss_curve": [steps, loss],
            "run_dir": str(run_dir)}


def dense_results(arms: dict[str, Arm], scale: Scale, t4_info: dict) -> dict:
    n_eval = scale.eval_size * scale.eval_samples
    res = {}
    for loops in (T, 1):
        arm = arms[f"dense-pretrain-T{loops}"]
        pre = {}
        if arm.status == "done":
            run = arm.run_dir if arm.argv is not None else Path(t4_info["model"]).parent
            pre = pretrain_summary(run)
            if arm.argv is None:
                pre["reused_cache"] = {k: t4_info.get(k) for k in ("model", "key", "train_seconds")}
        runs = [rl_summary(a.run_dir) for a in arms.values()
                if a.name.startswith(f"dense-rl-T{loops}-s") and a.status == "done"]
        res[f"T{loops}"] = {"pretrain": pre, "runs": runs, **aggregate(runs, n_eval)}
    a, b = res[f"T{T}"], res["T1"]
    if a.get("seeds") and b.get("seeds"):
        d = a["solve_start"] - b["solve_start"]
        se = math.sqrt(binom_se(a["solve_start"], n_eval) ** 2 + binom_se(b["solve_start"], n_eval) ** 2)
        res["start_difference"] = [d, se]
        res["end_difference"] = [a["solve_end"] - b["solve_end"], math.sqrt(a["se"] ** 2 + b["se"] ** 2)]
    return res


def credit_results(arms: dict[str, Arm], scale: Scale) -> dict:
    n_eval = scale.eval_size * scale.eval_samples
    res = {}
    for kind in CREDIT:
        runs = [rl_summary(a.run_dir) for a in arms.values()
                if a.name.startswith(f"credit-{kind}-s") and a.status == "done"]
        res[kind] = {"runs": runs, **aggregate(runs, n_eval)}
    res["rltt_vs_final"] = {k: diff_verdict(res[k], res["final"], k, "final")
                            for k in ("rltt-exit_pdf", "rltt-progressive")}
    res["exit_vs_final"] = diff_verdict(res["exit"], res["final"], "exit", "final")
    return res


# --------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9})
    return plt


def _bars(ax, names: list[str], aggs: list[dict], key: str = "gain", scale: float = 100.0) -> None:
    for i, (name, agg) in enumerate(zip(names, aggs)):
        if not agg.get("seeds"):
            continue
        ax.bar(i, scale * agg[key], color=f"C{i}", alpha=0.6)
        if key == "gain":
            ax.errorbar(i, scale * agg[key], yerr=scale * 2 * agg["se"], color="k", capsize=3, lw=1)
            ax.plot([i] * len(agg["gains"]), [scale * g for g in agg["gains"]], "k.", ms=4)
    ax.set_xticks(range(len(names)), names)
    ax.axhline(0, color="k", lw=0.5)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    _plt().close(fig)


def plot_band(res: dict, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    rates = res["pool_rates"]
    axes[0].hist(rates, bins=[i / 16 - 1 / 32 for i in range(18)], color="0.6")
    for i, (band, (lo, hi)) in enumerate(BANDS.items()):
        axes[0].axvspan(lo - 0.015, hi + 0.015, color=f"C{i}", alpha=0.15, label=band)
    axes[0].set(title="curated pool: per-prompt solve rate", xlabel="solve rate", ylabel="prompts")
    axes[0].legend()
    names = list(BANDS)
    aggs = [res["bands"][b] for b in names]
    _bars(axes[1], names, aggs)
    axes[1].set(title="held-out gain (points; ±2 SE, dots: seeds)", ylabel="points")
    for i, b in enumerate(names):
        steps, frac = _mean_series([r["series"]["groups/uniform_frac"] for r in res["bands"][b]["runs"]])
        if steps:
            axes[2].plot(steps, frac, color=f"C{i}", label=b)
    axes[2].set(title="uniform-group fraction (zero advantage)", xlabel="RL step", ylim=(0, 1.05))
    axes[2].legend()
    _save(fig, path)


def _mean_series(all_series: list) -> tuple[list[int], list[float]]:
    """The point-wise mean of several (steps, values) series over their common steps."""
    if not all_series:
        return [], []
    common = sorted(set.intersection(*(set(s) for s, _ in all_series)))
    maps = [dict(zip(s, v)) for s, v in all_series]
    return common, [mean([m[s] for m in maps]) for s in common]


def plot_lr(res: dict, path: Path) -> None:
    plt = _plt()
    from rltt.telemetry.diagnoses import KL_DRIFT_MAX, KL_STUCK_MAX

    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    names = list(res)
    for i, name in enumerate(names):
        for j, run in enumerate(res[name]["runs"]):
            steps, kl = run["series"]["kl/ref"]
            axes[0].plot(steps, [max(k, 1e-9) for k in kl], color=f"C{i}", label=f"lr {name}" if j == 0 else None)
            steps, g = run["series"]["grad_norm/total"]
            axes[1].plot(steps, g, color=f"C{i}", lw=0.8)
    axes[0].axhline(KL_STUCK_MAX, color="k", ls="--", lw=0.7)
    axes[0].axhline(KL_DRIFT_MAX, color="k", ls=":", lw=0.7)
    axes[0].set(yscale="log", title="KL to the reference (review thresholds dashed)", xlabel="RL step")
    axes[0].legend()
    axes[1].set(yscale="log", title="grad norm (before clipping)", xlabel="RL step")
    _bars(axes[2], [f"{n}" for n in names], [res[n] for n in names])
    axes[2].set(title="held-out gain (points)", xlabel="lr")
    _save(fig, path)


def plot_dense(res: dict, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    names = [f"T{T}", "T1"]
    for i, name in enumerate(names):
        pre = res[name]["pretrain"]
        if pre:
            axes[0].plot(*pre["loss_curve"], color=f"C{i}", label=f"{name} (train lm/loss)", lw=0.8)
    axes[0].set(yscale="log", title="pretraining LM loss", xlabel="step")
    axes[0].legend()
    x = range(len(names))
    for i, name in enumerate(names):
        pre = res[name]["pretrain"]
        if pre and pre.get("lm_loss") is not None:
            axes[1].bar(i - 0.2, pre["lm_loss"], 0.4, color="C0", alpha=0.6, label="held-out LM loss" if i == 0 else None)
        agg = res[name]
        if agg.get("seeds"):
            axes[1].bar(i + 0.2, agg["solve_start"], 0.4, color="C1", alpha=0.6,
                        label="held-out solve rate" if i == 0 else None)
    axes[1].set_xticks(list(x), names)
    axes[1].set(title="after pretraining")
    axes[1].legend(loc="lower center", fontsize=6)
    _bars(axes[2], names, [res[n] for n in names])
    axes[2].set(title="held-out gain after equal RL steps (points)")
    _save(fig, path)


def plot_credit(res: dict, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    names = list(CREDIT)
    aggs = [res[n] for n in names]
    _bars(axes[0], [n.replace("rltt-", "rltt\n") for n in names], aggs)
    axes[0].set(title="held-out gain (points)")
    width = 0.8 / (len(names) + 1)
    start = next((a["exit_p_first"] for a in aggs if a.get("seeds")), None)
    if start:
        axes[1].bar([t - 0.4 + width / 2 for t in range(1, T + 1)], start, width, color="0.6", label="start")
    for i, (name, agg) in enumerate(zip(names, aggs)):
        if agg.get("seeds"):
            axes[1].bar([t - 0.4 + width * (i + 1.5) for t in range(1, T + 1)], agg["exit_p_last"], width,
                        color=f"C{i}", label=name)
    axes[1].set(title="exit distribution p_t on the rollouts, after RL", xlabel="loop t")
    axes[1].legend(fontsize=6, loc="lower center", ncol=2)
    for i, name in enumerate(names):
        steps, v = _mean_series([r["series"]["exit/mean_step"] for r in res[name]["runs"]])
        if steps:
            axes[2].plot(steps, v, color=f"C{i}", label=name, lw=0.8)
    axes[2].set(title="mean exit step of the rollouts", xlabel="RL step")
    axes[2].legend(fontsize=6)
    _save(fig, path)


# --------------------------------------------------------------------------- Markdown


def table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(r) + " |" for r in rows)])


def gain_cell(agg: dict) -> str:
    if not agg.get("seeds"):
        return "not run"
    seeds = ", ".join(pts(g) for g in agg["gains"])
    return f"**{pts(agg['gain'])}** ± {100 * agg['se']:.1f} ({seeds})"


def span(agg: dict, a: str, b: str, spec: str = ".3f") -> str:
    return f"{fmt(agg.get(a, NAN), spec)} → {fmt(agg.get(b, NAN), spec)}"


def commands(arms: dict[str, Arm], prefix: str) -> str:
    shown = [a for a in arms.values() if a.name.startswith(prefix)]
    lines = [a.command for a in shown if not a.argv] + [a.command for a in shown if a.argv]
    return "```\n" + "\n".join(lines) + "\n```"


def paragraphs(*parts: str) -> str:
    return "\n\n".join(p.strip("\n") for p in parts if p and p.strip()) + "\n"


def md_band(res: dict, arms: dict[str, Arm], scale: Scale, fig: str) -> str:
    pool = ", ".join(f"{p} {fmt(v['mean_solve_rate'], '.2f')}" for p, v in res["pool"].items())
    rows = []
    for band, b in res["bands"].items():
        mix = ", ".join(f"{p} {n}" for p, n in b["by_preset"].items() if n)
        rows.append([band, f"{b['window'][0]:g}–{b['window'][1]:g}", f"{b['prompts']} ({mix})",
                     fmt(b["curated_solve_rate"], ".2f"), fmt(b.get("train_solve_rate", NAN), ".2f"),
                     fmt(b.get("uniform_frac", NAN), ".2f"), span(b, "solve_start", "solve_end"), gain_cell(b)])
    return paragraphs(
        "### 1. Solve-rate band",
        f"Pool: {scale.pool_per_preset} problems of each synthetic difficulty preset, curated by the quickstart "
        f"model with {scale.curate_samples} samples per prompt (temperature 1); mean solve rate per preset: {pool}. "
        f"Each band's kept set gets the same RL budget: {scale.rl_steps} steps of the quickstart recipe "
        f"(8 prompts × G = 8), {scale.seeds} seed(s); held-out: {scale.eval_size} synthetic:quickstart problems "
        f"× {scale.eval_samples} samples, the same set for every band.",
        table(["band", "kept window", "prompts (by preset)", "curated solve rate", "RL batch solve rate",
               "uniform-group fraction", "held-out start → end", "held-out gain, points (± SE; per seed)"], rows),
        f"- {res['mixed_vs_high'][2]}.\n- {res['mixed_vs_low'][2]}.",
        f"![solve-rate band]({fig})", "Commands:", commands(arms, "band-"))


def review_flags(r: dict) -> str:
    return "; ".join(sorted({f"`{d['id']}` ({d['severity']})" for rv in r["reviews"] for d in rv["diagnoses"]})) \
        or "none"


def md_lr(res: dict, arms: dict[str, Arm], scale: Scale, fig: str) -> str:
    rows = [[name, fmt(r.get("kl_late_median", NAN), ".2e"), fmt(r.get("kl_end", NAN), ".2e"),
             fmt(r.get("grad_norm_median", NAN), ".3f"), span(r, "solve_start", "solve_end"), gain_cell(r),
             review_flags(r)] for name, r in res.items()]
    evidence = [f"- lr {name}, `{d['id']}`: " + "; ".join(d["evidence"])
                for name, r in res.items() for rv in r["reviews"][:1] for d in rv["diagnoses"]]
    return paragraphs(
        "### 2. Learning rate",
        f"The quickstart recipe at each lr, {scale.lr_steps} steps (5 of warmup), {scale.lr_seeds} seed(s), then "
        "`rltt review RUN_DIR --no-plots` on each run (kl/ref is logged every step; the not-moving check needs 20 "
        "points, the drift check 10).",
        table(["lr", "kl/ref, median of the late half", "kl/ref at the end", "grad norm median",
               "held-out start → end", "held-out gain, points", "`rltt review` diagnoses"], rows),
        "Review evidence:\n\n" + ("\n".join(evidence) or "- (no diagnosis fired)"),
        f"![learning rate]({fig})", "Commands:", commands(arms, "lr-"))


def md_dense(res: dict, arms: dict[str, Arm], scale: Scale, fig: str) -> str:
    rows = []
    for name in (f"T{T}", "T1"):
        pre, r = res[name]["pretrain"], res[name]
        per_loop = ", ".join(fmt(v) for v in pre.get("lm_loss_per_loop", []) if v is not None)
        rows.append([name, fmt(pre.get("lm_loss", NAN)), per_loop or "–", fmt(pre.get("solve_rate", NAN)),
                     span(r, "solve_start", "solve_end"), gain_cell(r), fmt(r.get("step_seconds", NAN), ".2f")])
    note = ""
    if arms[f"dense-pretrain-T{T}"].argv is None:
        info = res[f"T{T}"]["pretrain"].get("reused_cache", {})
        note = (f"The T = {T} arm is the cached quickstart model (`{info.get('model')}`): `{PRETRAIN_RECIPE}` as "
                "`rltt.lm_training.quickstart_model` runs it, the same recipe and data as the T = 1 arm (deterministic on one "
                "thread; `--retrain-t4` runs it again).")
    diff = ""
    if "start_difference" in res:
        (d, se), (e, se_e) = res["start_difference"], res["end_difference"]
        diff = (f"- Held-out solve rate (RL evaluation), T = {T} minus T = 1: {pts(d)} ± {100 * se:.1f} points before "
                f"RL, {pts(e)} ± {100 * se_e:.1f} after {scale.rl_steps} RL steps.")
    return paragraphs(
        "### 3. Dense twin",
        f"`{PRETRAIN_RECIPE}` with `model.config.num_loops` = {T} and = 1: the same shared block (the same "
        f"parameters), tokenizer recipe, data, order and steps; T = 1 spends 1/{T} of the block compute. Then "
        f"{scale.rl_steps} steps of the quickstart recipe from each, {scale.dense_seeds} seed(s). {note}",
        table(["model", "held-out LM loss (Σ p_t L_t)", "per-loop LM loss L_1..L_T", "pretrain eval solve rate",
               "RL held-out start → end", "RL gain, points", "RL step s"], rows),
        diff, f"![dense twin]({fig})", "Commands:", commands(arms, "dense-"))


def md_credit(res: dict, arms: dict[str, Arm], scale: Scale, fig: str) -> str:
    rows = []
    for kind in CREDIT:
        r = res[kind]
        p0 = ", ".join(fmt(v, ".2f") for v in r.get("exit_p_first", [])) or "–"
        p1 = ", ".join(fmt(v, ".2f") for v in r.get("exit_p_last", [])) or "–"
        rows.append([kind, span(r, "solve_start", "solve_end"), gain_cell(r), f"{p0} → {p1}",
                     span(r, "exit_step_start", "exit_step_end", ".2f"), fmt(r.get("step_seconds", NAN), ".2f")])
    verdicts = [res["exit_vs_final"][2], *(v[2] for v in res["rltt_vs_final"].values())]
    return paragraphs(
        "### 4. Per-loop credit",
        f"The quickstart recipe with `rollout.exit_policy=sample` (each token's exit drawn from the gate) and each "
        f"`algorithm.policy_logprob`, {scale.rl_steps} steps, {scale.credit_seeds} seed(s), the same seeds for every arm. "
        "Held-out evaluation samples exits too.",
        table(["policy_logprob", "held-out start → end", "held-out gain, points",
               "rollout exit p_1..p_4: first step → last 10 % of steps", "held-out mean exit step", "step s"], rows),
        "\n".join(f"- {v}." for v in verdicts), f"![per-loop credit]({fig})", "Commands:", commands(arms, "credit-"))


# --------------------------------------------------------------------------- main


def finished(arm: Arm) -> bool:
    """Whether a CLI arm's outputs in --out are complete (a train run: its last step logged with
    the final evaluation; a pretraining run: its summary; a curation: its kept set)."""
    if arm.argv[0] == "curate":
        kept = Path(arm.argv[arm.argv.index("--kept") + 1])
        return (kept if kept.is_absolute() else ROOT / kept).is_file()
    if arm.argv[0] == "pretrain":
        return (arm.run_dir / "summary.json").is_file()
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
    return arms


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench-findings", help="output directory (default runs/bench-findings)")
    parser.add_argument("--smoke", action="store_true", help="one seed, a few steps per arm, tiny evaluations")
    parser.add_argument("--jobs", type=int, default=2, help="arms run at once (one CPU thread each; default 2)")
    parser.add_argument("--only", default=",".join(FINDINGS), help=f"findings to run (default {','.join(FINDINGS)})")
    parser.add_argument("--seeds", type=int, default=None, help="seeds of the band arms")
    parser.add_argument("--credit-seeds", type=int, default=None, help="seeds of the per-loop credit arms")
    parser.add_argument("--steps", type=int, default=None, help="RL steps of the band, dense and credit arms")
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
    return args


def run(args: argparse.Namespace) -> dict:
    scale = SMOKE if args.smoke else FULL
    for key, value in (("seeds", args.seeds), ("credit_seeds", args.credit_seeds), ("rl_steps", args.steps),
                       ("lr_steps", args.lr_steps), ("eval_size", args.eval_size)):
        if value is not None:
            if value < 1:
                raise SystemExit(f"findings: --{key.replace('_', '-')} must be >= 1")
            scale = replace(scale, **{key: value})
    out = Path(args.out).resolve()
    t4_info: dict = {}
    arms = build_arms(out, scale, args.only, args.retrain_t4, t4_info)
    start = time.perf_counter()
    if args.report_only:
        mark_finished(arms, report_only=True)
    elif args.resume:
        mark_finished(arms, report_only=False)
        run_arms(arms, out / "logs", args.jobs)
    else:
        for sub in ("runs", "band", "logs"):
            shutil.rmtree(out / sub, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        run_arms(arms, out / "logs", args.jobs)
    elapsed = time.perf_counter() - start
    if args.report_only and (out / "findings.json").is_file():  # the time of the run it reports
        elapsed = json.loads((out / "findings.json").read_text()).get("seconds", elapsed)

    figures = {}
    results: dict = {}
    builders = {"band": (lambda: band_results(out, arms, scale), plot_band, md_band),
                "lr": (lambda: lr_results(arms, scale), plot_lr, md_lr),
                "dense": (lambda: dense_results(arms, scale, t4_info), plot_dense, md_dense),
                "credit": (lambda: credit_results(arms, scale), plot_credit, md_credit)}
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

    mode = "smoke" if args.smoke else "full"
    flags = [f"--out {rel(out)}", *(["--smoke"] if args.smoke else []),
             *([f"--only {','.join(args.only)}"] if args.only != FINDINGS else []),
             *(f"--{k.replace('_', '-')} {v}" for k, v in (("seeds", args.seeds), ("credit_seeds", args.credit_seeds),
                                                          ("steps", args.steps),
                                                          ("lr_steps", args.lr_steps), ("eval_size", args.eval_size))
               if v is not None),
             *([f"--jobs {args.jobs}"] if args.jobs != 2 else []), *(["--retrain-t4"] if args.retrain_t4 else [])]
    failed = {a.name: a.error for a in arms.values() if a.status != "done"}
    header = paragraphs(
        SECTION,
        f"Command ({'smoke' if args.smoke else 'full'} mode; {len(arms)} arms, {args.jobs} at a time, one CPU thread "
        f"each; {elapsed / 60:.1f} min wall on {os.cpu_count()} CPU cores):",
        "    python bench/findings.py " + " ".join(flags),
        "Every arm is a real `rltt curate` / `rltt train` / `rltt pretrain` run of the shipped recipes (the exact "
        "commands are under each finding). Held-out solve rates are at temperature 1. SE: the binomial standard "
        "error of a mean final solve rate over all held-out samples of its seeds (a problem's samples are "
        "correlated, so it is a slight underestimate); arms of the same seed start from the same evaluation.",
        "Arms not done: " + "; ".join(f"{k} ({v})" for k, v in failed.items()) if failed else "")
    markdown = header + "\n" + "\n".join(sections)
    (out / "findings.md").write_text(markdown)
    report = {"mode": mode, "seconds": elapsed, "scale": vars(scale), "only": list(args.only),
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


if __name__ == "__main__":
    sys.exit(main())
