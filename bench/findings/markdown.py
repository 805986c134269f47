"""The Markdown report (``OUT/findings.md``): a header with the command that made it, then a
section per finding (a table, the verdicts, its figure and the exact commands of its arms)."""

from __future__ import annotations

import os

from .credit import CREDIT
from .dense import PRETRAIN_RECIPE
from .metrics import fmt, pts
from .runner import Arm, Scale, T

SECTION = "## RL findings at small scale (bench/findings/)"
NAN = float("nan")


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


def header(command: str, smoke: bool, n_arms: int, jobs: int, elapsed: float, failed: dict[str, str]) -> str:
    """The report's heading: how it ran (``command``: the findings command line) and which arms did not finish."""
    return paragraphs(
        SECTION,
        f"Command ({'smoke' if smoke else 'full'} mode; {n_arms} arms, {jobs} at a time, one CPU thread "
        f"each; {elapsed / 60:.1f} min wall on {os.cpu_count()} CPU cores):",
        "    " + command,
        "Every arm is a real `rltt curate` / `rltt train` / `rltt pretrain` run of the shipped recipes (the exact "
        "commands are under each finding). Held-out solve rates are at temperature 1. SE: the binomial standard "
        "error of a mean final solve rate over all held-out samples of its seeds (a problem's samples are "
        "correlated, so it is a slight underestimate); arms of the same seed start from the same evaluation.",
        "Arms not done: " + "; ".join(f"{k} ({v})" for k, v in failed.items()) if failed else "")


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
        diff = (f"- Held-out solve rate (the RL runs' own evaluations), T = {T} minus T = 1: {pts(d)} ± {100 * se:.1f} "
                f"points before RL, {pts(e)} ± {100 * se_e:.1f} after {scale.rl_steps} RL steps (binomial SEs).")
    paired = res.get("paired", {})
    paired_rows = [[label, _pass1_cell(paired.get(stage, {}).get(f"T{T}")), _pass1_cell(paired.get(stage, {}).get("T1")),
                    _diff_cell(paired.get(stage, {}).get("difference"))]
                   for stage, label in (("pre", "after pretraining"), ("rl", f"after {scale.rl_steps} RL steps"))]
    return paragraphs(
        "### 3. Dense twin",
        f"`{PRETRAIN_RECIPE}` with `model.config.num_loops` = {T} and = 1: the same shared block (the same "
        f"parameters), tokenizer recipe, data, order and steps; T = 1 spends 1/{T} of the block compute. Then "
        f"{scale.rl_steps} steps of the quickstart recipe from each, {scale.dense_seeds} seed(s). {note}",
        table(["model", "held-out LM loss (Σ p_t L_t)", "per-loop LM loss L_1..L_T", "pretrain eval solve rate",
               "RL held-out start → end", "RL gain, points", "RL step s"], rows),
        diff,
        f"Each model under `rltt eval --out` ({scale.eval_size} held-out problems × {scale.eval_samples} samples, the "
        "same problems for every model; RL seeds pooled by a two-level bootstrap over problems and seeds): pass@1 with "
        f"its 95 % interval, and T = {T} − T = 1 paired over the problems (`rltt.evaluation`: 95 % interval, p-value).",
        table(["stage", f"T = {T} pass@1 [95 %]", "T = 1 pass@1 [95 %]", f"T = {T} − T = 1, points"], paired_rows),
        f"![dense twin]({fig})", "Commands:", commands(arms, "dense-"))


def md_credit(res: dict, arms: dict[str, Arm], scale: Scale, fig: str) -> str:
    kinds = res.get("kinds", list(CREDIT))
    rows = []
    for kind in kinds:
        r = res[kind]
        p0 = ", ".join(fmt(v, ".2f") for v in r.get("exit_p_first", [])) or "–"
        p1 = ", ".join(fmt(v, ".2f") for v in r.get("exit_p_last", [])) or "–"
        rows.append([kind, span(r, "solve_start", "solve_end"), gain_cell(r), _pass1_cell(r.get("pass1")),
                     _diff_cell(res.get("vs_final", {}).get(kind)) if kind != "final" else "(baseline)",
                     f"{p0} → {p1}", span(r, "exit_step_start", "exit_step_end", ".2f"),
                     fmt(r.get("step_seconds", NAN), ".2f")])
    verdicts = [r["gain_vs_final"][2] for r in (res[k] for k in kinds) if "gain_vs_final" in r]
    paired = [f"{kind} − final, final checkpoints (`rltt eval`, {scale.eval_size} problems × {scale.eval_samples} "
              f"samples per seed): {_diff_cell(d)} ({d.get('test', '?')} test)"
              for kind, d in res.get("vs_final", {}).items() if d and "error" not in d]
    return paragraphs(
        "### 4. Per-loop credit",
        f"The quickstart recipe with `rollout.exit_policy=sample` (each token's exit drawn from the gate) and each "
        f"`algorithm.policy_logprob`, {scale.rl_steps} steps, {scale.credit_seeds} seed(s), the same seeds for every arm. "
        "Held-out evaluation samples exits too. Gain: the run's own held-out evaluations (step 0 → last), mean over "
        "seeds ± binomial SE. pass@1: the final checkpoints under `rltt eval`, pooled over seeds (two-level bootstrap "
        "over problems and seeds, 95 % interval); Δ: minus `final` on the same problems, 95 % interval and p-value "
        "(permutation of whole runs between the arms).",
        table(["policy_logprob", "held-out start → end", "held-out gain, points", "final pass@1 [95 % CI]",
               "Δ pass@1 vs final [95 % CI], p", "rollout exit p_1..p_4: first step → last 10 % of steps",
               "held-out mean exit step", "step s"], rows),
        "\n".join(f"- {v}." for v in [*verdicts, *paired]), f"![per-loop credit]({fig})", "Commands:",
        commands(arms, "credit-"))


def _pass1_cell(est: dict | None) -> str:
    if not est:
        return "not run"
    lo, hi = est["ci95"]
    return f"{est['mean']:.3f} [{lo:.3f}, {hi:.3f}]"


def _diff_cell(diff: dict | None) -> str:
    if not diff:
        return "–"
    if "error" in diff:
        return diff["error"]
    (lo, hi), unbounded = diff["ci95"], ("−∞", "+∞")  # an end is None when too few runs bound it
    lo, hi = (end if x is None else f"{100 * x:+.1f}" for x, end in zip((lo, hi), unbounded))
    return f"{pts(diff['mean'])} [{lo}, {hi}], p = {diff['p_value']:.3g}"


def md_depth(res: dict, arms: dict[str, Arm], scale: Scale, fig: str) -> str:
    rows = []
    for stage, label in (("pre", "after pretraining"), ("rl", f"after {scale.rl_steps} RL steps")):
        for hops in res["hops"]:
            row = res["stages"][stage].get(hops) or res["stages"][stage].get(str(hops), {})
            rows.append([label, str(hops), _pass1_cell(row.get(f"T{T}")), _pass1_cell(row.get("T1")),
                         _diff_cell(row.get("difference"))])
    pre_rows = []
    for name in (f"T{T}", "T1"):
        pre = res["pretrain"].get(name) or {}
        per_loop = ", ".join(fmt(v) for v in pre.get("lm_loss_per_loop", []) if v is not None)
        pre_rows.append([name, fmt(pre.get("lm_loss", NAN)), per_loop or "–", fmt(pre.get("solve_rate", NAN)),
                         fmt(pre.get("train_seconds", NAN), ".0f")])
    return paragraphs(
        "### 5. Depth: the dense twin on multi-hop lookups",
        f"`{PRETRAIN_RECIPE}` on `{res.get('source', 'synthetic:chains')}` (`rltt.data.chains`: "
        f"{min(res['hops'])}–{max(res['hops'])} lookups among distractor chains, "
        f"the answer alone, so every hop is resolved inside the forward pass) with `model.config.num_loops` = {T} "
        f"and = 1 (the same block and data, {scale.depth_pretrain_steps} steps"
        f"{''.join(f', `{o}`' for o in scale.depth_pretrain_overrides)}), then {scale.rl_steps} RL steps of "
        f"the quickstart recipe on the same task from each ({scale.depth_seeds} seed(s)). Each model is evaluated "
        f"on {scale.depth_eval_size} held-out problems of {min(res['hops'])}–{max(res['hops'])} hops × {scale.eval_samples} samples (`rltt eval "
        f"--out`), split by hop count; pass@1 with its 95 % bootstrap interval, and T = {T} − T = 1 paired over "
        "the same problems (`rltt.evaluation`: interval and p-value; RL seeds pooled).",
        table(["model", "held-out LM loss (Σ p_t L_t)", "per-loop LM loss L_1..L_T", "pretrain eval solve rate",
               "pretrain s"], pre_rows),
        table(["stage", "hops", f"T = {T} pass@1 [95 %]", "T = 1 pass@1 [95 %]", f"T = {T} − T = 1, points"], rows),
        f"![depth]({fig})", "Commands:", commands(arms, "depth-"))
