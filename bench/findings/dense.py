"""Finding 3, the dense twin: ``recipes/pretrain-tiny.yaml`` at T = 4 and at T = 1 (the same
block, so the same parameters, and the same data): held-out LM loss and solve rate after
pretraining, then equal RL steps from each. The T = 4 arm is the cached quickstart model unless
``--retrain-t4`` (or the smoke mode) pretrains it again. Every model (after pretraining, and each
RL seed's final checkpoint) is evaluated with ``rltt eval --out`` on the same held-out problems and
T = 4 is compared with T = 1 by `rltt.evaluation`: pass@1 with 95 % intervals (seeds pooled), the
difference paired over problems, and its p-value."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from .metrics import aggregate, binom_se, paired_pass1, read_records, rl_summary, series
from .runner import Arm, Scale, T, done_arms, eval_arm, final_checkpoint, rel, train_arm

PRETRAIN_RECIPE = "recipes/pretrain-tiny.yaml"


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


def eval_file(out: Path, model: str) -> Path:
    """``rltt eval --out`` of ``model`` (``pre-T4``, ``rl-T1-s0`` ...)."""
    return out / "dense" / f"{model}.json"


def dense_eval(out: Path, scale: Scale, model: str, checkpoint: Path | None, dep: str) -> Arm:
    """``rltt eval`` of ``checkpoint`` (the quickstart model when None) on the RL arms' held-out problems."""
    return eval_arm(f"dense-eval-{model}", checkpoint, eval_file(out, model), scale.eval_samples, (dep,),
                    overrides=(f"data.eval_size={scale.eval_size}",))


def dense_arms(out: Path, scale: Scale, retrain_t4: bool, t4_info: dict) -> dict[str, Arm]:
    arms = {}
    (out / "dense").mkdir(parents=True, exist_ok=True)
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
        reused = arms[name].argv is None
        arm = dense_eval(out, scale, f"pre-T{loops}", None if reused else run / "final", name)
        arms[arm.name] = arm
        for seed in range(scale.dense_seeds):
            rl = f"dense-rl-T{loops}-s{seed}"
            model = "quickstart" if reused else rel(run / "final")
            arms[rl] = train_arm(out, scale, rl, seed, scale.rl_steps, [f"model.path={model}"],
                                 cost=scale.rl_steps / 60 * (4 if loops == T else 2), deps=(name,), keep_final=True)
            arm = dense_eval(out, scale, f"rl-T{loops}-s{seed}", final_checkpoint(arms[rl].run_dir, scale.rl_steps), rl)
            arms[arm.name] = arm
    return arms


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


def dense_results(out: Path, arms: dict[str, Arm], scale: Scale, t4_info: dict) -> dict:
    """Per model: the pretraining summary and the RL runs' own evaluations (binomial SEs); per stage
    (``pre``, ``rl``): pass@1 of the ``rltt eval`` results and T = 4 − T = 1 paired over problems."""
    n_eval = scale.n_eval
    res = {}
    for loops in (T, 1):
        arm = arms[f"dense-pretrain-T{loops}"]
        pre = {}
        if arm.status == "done":
            run = arm.run_dir if arm.argv is not None else Path(t4_info["model"]).parent
            pre = pretrain_summary(run)
            if arm.argv is None:
                pre["reused_cache"] = {k: t4_info.get(k) for k in ("model", "key", "train_seconds")}
        runs = [rl_summary(a.run_dir) for a in done_arms(arms, f"dense-rl-T{loops}-s")]
        res[f"T{loops}"] = {"pretrain": pre, "runs": runs, **aggregate(runs, n_eval)}
    a, b = res[f"T{T}"], res["T1"]
    if a.get("seeds") and b.get("seeds"):
        d = a["solve_start"] - b["solve_start"]
        se = math.sqrt(binom_se(a["solve_start"], n_eval) ** 2 + binom_se(b["solve_start"], n_eval) ** 2)
        res["start_difference"] = [d, se]
        res["end_difference"] = [a["solve_end"] - b["solve_end"], math.sqrt(a["se"] ** 2 + b["se"] ** 2)]
    res["paired"] = {
        "pre": paired_pass1([eval_file(out, f"pre-T{T}")], [eval_file(out, "pre-T1")], names=(f"T{T}", "T1")),
        "rl": paired_pass1(*([eval_file(out, f"rl-T{L}-s{s}") for s in range(scale.dense_seeds)] for L in (T, 1)),
                           names=(f"T{T}", "T1"))}
    return res
