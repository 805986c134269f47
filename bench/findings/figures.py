"""The figure of each finding (``OUT/<finding>.png``, three panels each), drawn from its results."""

from __future__ import annotations

from pathlib import Path

from .band import BANDS
from .credit import CREDIT
from .metrics import mean
from .runner import T


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


def _mean_series(all_series: list) -> tuple[list[int], list[float]]:
    """The point-wise mean of several (steps, values) series over their common steps."""
    if not all_series:
        return [], []
    common = sorted(set.intersection(*(set(s) for s, _ in all_series)))
    maps = [dict(zip(s, v)) for s, v in all_series]
    return common, [mean([m[s] for m in maps]) for s in common]


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
    names = res.get("kinds", list(CREDIT))
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


def plot_depth(res: dict, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, stage, title in ((axes[0], "pre", "after pretraining"), (axes[1], "rl", "after RL")):
        for i, name in enumerate((f"T{T}", "T1")):
            xs, ys, lo, hi = [], [], [], []
            for hops in res["hops"]:
                est = (res["stages"][stage].get(hops) or res["stages"][stage].get(str(hops), {})).get(name)
                if est:
                    xs.append(hops)
                    ys.append(est["mean"])
                    lo.append(est["mean"] - est["ci95"][0])
                    hi.append(est["ci95"][1] - est["mean"])
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], color=f"C{i}", marker="o", capsize=3, label=name)
        ax.set(title=f"held-out pass@1 by hops, {title}", xlabel="hops", ylim=(0, 1))
        ax.legend()
    _save(fig, path)
