"""The review's figures. Uses matplotlib's object API with the Agg canvas (no pyplot, no
global backend switch), so it works headless and inside a training process.

Every plot takes a list of runs: the first is the run under review (solid lines), the others
are ``--compare`` runs (dashed lines, or a panel of their own for the stacked/heatmap plots).
A plot whose metrics no run logged is skipped.

Line plots draw each series twice: the raw points as a faint line and, over it, a smoothed
curve — a centred rolling mean (:func:`smooth`) over :data:`SMOOTH_FRACTION` of the points
(an odd window of at least 3; near the ends the window shrinks to the points available, so the
curve neither lags nor is padded). On a log axis the mean is taken of the logarithms (a
geometric mean). Series with fewer than :data:`SMOOTH_MIN_POINTS` points (held-out evaluations,
a run that just started) are drawn raw, with markers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from rltt.telemetry import diagnoses as dx
from rltt.telemetry import schema
from rltt.telemetry.series import RunData

LINESTYLES = ("-", "--", ":", "-.")
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
          "tab:pink", "tab:gray", "tab:olive", "tab:cyan")
DPI = 90

#: Share of a series' points the smoothing window spans.
SMOOTH_FRACTION = 0.05
#: Series shorter than this are drawn raw (no smoothed curve).
SMOOTH_MIN_POINTS = 10
#: Opacity of the raw line under a smoothed curve.
RAW_ALPHA = 0.25


def smoothing_window(n: int) -> int:
    """The rolling-mean window for a series of ``n`` points: odd, >= 3, ~SMOOTH_FRACTION·n."""
    w = max(3, int(round(n * SMOOTH_FRACTION)))
    return w if w % 2 else w + 1


def smooth(values: np.ndarray, window: int | None = None, log: bool = False) -> np.ndarray:
    """Centred rolling mean of ``values`` over ``window`` points (default
    :func:`smoothing_window`); the window is truncated at both ends. ``log``: average the
    logarithms (for positive series on a log axis). A window <= 1 returns a copy."""
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    window = smoothing_window(n) if window is None else int(window)
    if window <= 1 or n == 0:
        return v.copy()
    x = np.log(v) if log else v
    half = window // 2
    cum = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(n)
    lo, hi = np.maximum(idx - half, 0), np.minimum(idx + half + 1, n)
    out = (cum[hi] - cum[lo]) / (hi - lo)
    return np.exp(out) if log else out


@dataclass(frozen=True)
class PlotSpec:
    """A figure of the report: file stem, caption, and the function drawing it."""

    name: str
    title: str
    draw: Callable[[Sequence[RunData]], Figure | None]


def _figure(rows: int = 1, cols: int = 1, height: float = 3.4) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(10, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False).ravel())
    return fig, axes


def _lines(ax, runs: Sequence[RunData], keys: Sequence[str], logy: bool = False,
           colors: Sequence[str] | None = None) -> bool:
    """Plot each key of each run; True when anything was drawn.

    Colour = key, line style = run; the legend (outside, right) names each key once and,
    when comparing, each run's line style. A series of at least SMOOTH_MIN_POINTS points is
    drawn raw and faint, then smoothed (:func:`smooth`) on top; the smoothed line carries the
    label (its ``gid`` is ``"smooth:<key>"``, the raw one's ``"raw:<key>"``).
    """
    palette = colors or COLORS
    labelled: set[str] = set()
    drawn_runs: list[int] = []
    for r, run in enumerate(runs):
        for k, key in enumerate(keys):
            steps, values = run.series(key)
            if logy:
                keep = values > 0
                steps, values = steps[keep], values[keep]
            if not len(values):
                continue
            style, color = LINESTYLES[r % len(LINESTYLES)], palette[k % len(palette)]
            label = None if key in labelled else key
            if len(values) >= SMOOTH_MIN_POINTS:
                ax.plot(steps, values, style, color=color, lw=0.8, alpha=RAW_ALPHA, gid=f"raw:{key}")
                ax.plot(steps, smooth(values, log=logy), style, color=color, lw=1.5, label=label,
                        gid=f"smooth:{key}")
            else:
                ax.plot(steps, values, style, color=color, lw=1.3, marker=".", label=label,
                        gid=f"raw:{key}")
            labelled.add(key)
            if r not in drawn_runs:
                drawn_runs.append(r)
    if not drawn_runs:
        return False
    if len(runs) > 1:
        for r in drawn_runs:
            ax.plot([], [], LINESTYLES[r % len(LINESTYLES)], color="black", lw=1.3,
                    label=f"[{runs[r].name}]")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return True


def _threshold(ax, value: float, text: str) -> None:
    ax.axhline(value, color="black", ls=":", lw=1)
    ax.annotate(text, (0.005, value), xycoords=("axes fraction", "data"), fontsize=7,
                va="bottom")


def _union(runs: Sequence[RunData], template: str) -> list[str]:
    keys: dict[object, str] = {}
    for run in runs:
        found = run.indexed(template) if "{t}" in template or "{i}" in template \
            else run.named(template)
        keys.update(found)
    return [keys[k] for k in sorted(keys)]


def _finish(fig: Figure, axes: np.ndarray, drawn: Sequence[bool], title: str) -> Figure | None:
    if not any(drawn):
        return None
    for ax, d in zip(axes, drawn):
        if not d:
            ax.set_axis_off()
    fig.suptitle(title, fontsize=11)
    return fig


# --------------------------------------------------------------------------- plots


def plot_reward(runs: Sequence[RunData]) -> Figure | None:
    fig, (a, b) = _figure(1, 2)
    drawn_a = _lines(a, runs, [schema.REWARD_MEAN, *_union(runs, schema.REWARD_FN)])
    if drawn_a:
        steps, mean = runs[0].series(schema.REWARD_MEAN)
        s2, std = runs[0].series(schema.REWARD_STD)
        common, i1, i2 = np.intersect1d(steps, s2, return_indices=True)
        if len(common):
            a.fill_between(common, mean[i1] - std[i2], mean[i1] + std[i2], alpha=0.15,
                           color=COLORS[0], label="± std")
        a.set_title("reward", fontsize=9)
    drawn_b = _lines(b, runs, [schema.SOLVE_RATE, schema.EVAL_SOLVE_RATE, schema.GROUPS_UNIFORM_FRAC])
    if drawn_b:
        b.set_ylim(-0.02, 1.02)
        _threshold(b, dx.UNIFORM_GROUPS_WARN, "uniform-groups warning")
        b.set_title("solve rate (training batch, held-out) / uniform groups", fontsize=9)
    return _finish(fig, np.array([a, b]), [drawn_a, drawn_b], "Reward and solve rate")


def plot_kl(runs: Sequence[RunData]) -> Figure | None:
    fig, (a, b) = _figure(1, 2)
    drawn_a = _lines(a, runs, [schema.KL_REF], logy=True)
    if drawn_a:
        _threshold(a, dx.KL_STUCK_MAX, "policy-not-moving level")
        a.set_title("KL to reference (nats/token)", fontsize=9)
    drawn_b = _lines(b, runs, [schema.POLICY_CLIP_FRAC, schema.POLICY_RATIO_MEAN,
                               schema.POLICY_RATIO_MAX, schema.POLICY_RATIO_MIN])
    if drawn_b:
        b.set_title("importance ratio / clip fraction", fontsize=9)
    return _finish(fig, np.array([a, b]), [drawn_a, drawn_b], "KL and policy update")


def plot_loss(runs: Sequence[RunData]) -> Figure | None:
    fig, (a, b) = _figure(1, 2)
    drawn_a = _lines(a, runs, [schema.LOSS_TOTAL, schema.LOSS_POLICY, schema.LOSS_KL])
    if drawn_a:
        a.set_title("RL losses", fontsize=9)
    drawn_b = _lines(b, runs, [schema.LM_LOSS, *_union(runs, schema.LM_LOSS_STEP)])
    if drawn_b:
        b.set_title("LM loss (expected, per loop)", fontsize=9)
    return _finish(fig, np.array([a, b]), [drawn_a, drawn_b], "Losses")


def plot_grad_norm(runs: Sequence[RunData]) -> Figure | None:
    fig, (a, b) = _figure(1, 2)
    drawn_a = _lines(a, runs, [schema.GRAD_NORM_TOTAL, schema.LR], logy=True)
    if drawn_a:
        a.set_title("total grad norm, lr", fontsize=9)
    drawn_b = _lines(b, runs, _union(runs, schema.GRAD_NORM_GROUP), logy=True)
    if drawn_b:
        b.set_title("grad norm per module group", fontsize=9)
    return _finish(fig, np.array([a, b]), [drawn_a, drawn_b], "Gradient norms")


def plot_grad_layers(runs: Sequence[RunData]) -> Figure | None:
    """Heatmap layer × step of the per-layer grad norm (log colour), one panel per run."""
    with_layers = [run for run in runs if run.indexed(schema.GRAD_NORM_LAYER)]
    if not with_layers:
        return None
    fig, axes = _figure(len(with_layers), 1, height=2.8)
    for ax, run in zip(axes, with_layers):
        layers = run.indexed(schema.GRAD_NORM_LAYER)
        steps = run.steps
        grid = np.full((len(layers), len(steps)), np.nan)
        col = {int(s): j for j, s in enumerate(steps)}
        for row, key in enumerate(layers.values()):
            s, v = run.series(key)
            grid[row, [col[int(x)] for x in s]] = v
        grid[grid <= 0] = np.nan
        if np.isnan(grid).all():
            ax.set_axis_off()
            continue
        vmin, vmax = np.nanmin(grid), np.nanmax(grid)
        image = ax.imshow(grid, aspect="auto", origin="lower", interpolation="nearest",
                          norm=LogNorm(vmin=vmin, vmax=max(vmax, vmin * 1.0001)),
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(layers) - 0.5))
        ax.set_yticks(range(len(layers)), [str(i) for i in layers])
        ax.set_ylabel("layer")
        ax.set_xlabel("step")
        ax.set_title(f"per-layer grad norm [{run.name}]", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.03)
    fig.suptitle("Gradient norm per layer", fontsize=11)
    return fig


def plot_exit(runs: Sequence[RunData]) -> Figure | None:
    """Stacked area of the mean exit probabilities p_t through training, one panel per run."""
    with_exit = [run for run in runs if run.indexed(schema.EXIT_P)]
    if not with_exit:
        return None
    fig, axes = _figure(len(with_exit), 1, height=3.0)
    for ax, run in zip(axes, with_exit):
        loops = run.indexed(schema.EXIT_P)
        columns = [dict(zip(*run.series(key))) for key in loops.values()]
        steps = sorted(set.intersection(*(set(c) for c in columns)))
        if not steps:
            ax.set_axis_off()
            continue
        stack = np.array([[c[s] for s in steps] for c in columns])
        ax.stackplot(steps, stack, labels=[f"p_{t}" for t in loops],
                     colors=[COLORS[i % len(COLORS)] for i in range(len(loops))], alpha=0.85)
        ax.set_ylim(0, 1)
        ax.set_xlabel("step")
        ax.set_ylabel("exit probability")
        ax.axhline(dx.EXIT_COLLAPSE_P1, color="black", ls=":", lw=1)
        ms, mean_step = run.series(schema.EXIT_MEAN_STEP)
        if len(mean_step):
            twin = ax.twinx()
            twin.plot(ms, mean_step, color="black", lw=1.2, label="mean exit step")
            twin.set_ylim(1, max(len(loops), 2))
            twin.set_ylabel("mean exit step")
            twin.legend(fontsize=7, loc="lower right")
        ax.legend(fontsize=7, loc="upper left", ncol=len(loops))
        ax.set_title(f"exit distribution over loops [{run.name}]", fontsize=9)
    fig.suptitle("Exit distribution", fontsize=11)
    return fig


def plot_entropy(runs: Sequence[RunData]) -> Figure | None:
    fig, (a, b) = _figure(1, 2)
    drawn_a = _lines(a, runs, _union(runs, schema.ENTROPY_LOOP))
    if drawn_a:
        a.set_title("token entropy per loop (nats)", fontsize=9)
    drawn_b = _lines(b, runs, [schema.EXIT_ENTROPY, schema.EXIT_COLLAPSE])
    if drawn_b:
        b.set_title("exit-distribution entropy H(p), collapse indicator", fontsize=9)
    return _finish(fig, np.array([a, b]), [drawn_a, drawn_b], "Entropy")


def plot_compute(runs: Sequence[RunData]) -> Figure | None:
    """What the rollout's tokens cost in loops (recorded exits, serial passes), how spread the exits
    are, the compute price paid, and the goodput."""
    fig, axes = _figure(1, 3)
    drawn = [
        _lines(axes[0], runs, [schema.COMPUTE_MEAN_EXIT, schema.COMPUTE_PASSES_PER_TOKEN,
                               schema.EVAL_COMPUTE_MEAN_EXIT, schema.EVAL_COMPUTE_PASSES_PER_TOKEN]),
        _lines(axes[1], runs, [schema.COMPUTE_EXIT_ENTROPY, schema.REWARD_COMPUTE]),
        _lines(axes[2], runs, [schema.THROUGHPUT_GOODPUT]),
    ]
    if drawn[1]:
        _threshold(axes[1], dx.COMPUTE_EXIT_ENTROPY_MIN, "collapse under a price")
    for ax, d, title in zip(axes, drawn, ("recorded exit step, passes / token", "exit-step entropy (nats), "
                                          "compute penalty", "goodput (solved completions / s)")):
        if d:
            ax.set_title(title, fontsize=9)
    return _finish(fig, axes, drawn, "Compute")


def plot_mismatch(runs: Sequence[RunData]) -> Figure | None:
    fig, (a, b) = _figure(1, 2)
    drawn_a = _lines(a, runs, [schema.MISMATCH_MAX_ABS, schema.MISMATCH_MEAN_ABS], logy=True)
    if drawn_a:
        _threshold(a, dx.MISMATCH_MAX_ABS_MAX, "max_abs limit")
        a.set_title("|logp_learner − logp_sampler| (nats)", fontsize=9)
    drawn_b = _lines(b, runs, [schema.MISMATCH_K3], logy=True)
    if drawn_b:
        _threshold(b, dx.MISMATCH_K3_MAX, "k3 limit")
        b.set_title("k3 KL(sampler || learner)", fontsize=9)
    return _finish(fig, np.array([a, b]), [drawn_a, drawn_b], "Sampler–learner log-prob mismatch")


def plot_lengths(runs: Sequence[RunData]) -> Figure | None:
    fig, (a, b) = _figure(1, 2)
    drawn_a = _lines(a, runs, [schema.LENGTH_MEAN, schema.LENGTH_MAX])
    if drawn_a:
        a.set_title("completion length (tokens)", fontsize=9)
    drawn_b = _lines(b, runs, [schema.LENGTH_TRUNC_FRAC])
    if drawn_b:
        b.set_ylim(-0.02, 1.02)
        _threshold(b, dx.TRUNC_FRAC_MAX, "truncation warning")
        b.set_title("truncated fraction", fontsize=9)
    return _finish(fig, np.array([a, b]), [drawn_a, drawn_b], "Completion lengths")


def plot_timings(runs: Sequence[RunData]) -> Figure | None:
    fig, axes = _figure(1, 3)
    drawn = [
        _lines(axes[0], runs, [schema.TIME_STEP, schema.TIME_ROLLOUT, schema.TIME_LEARNER,
                               schema.TIME_WEIGHT_SYNC]),
        _lines(axes[1], runs, [schema.THROUGHPUT_TOKENS_PER_S]),
        _lines(axes[2], runs, [schema.MEMORY_PEAK_GB]),
    ]
    for ax, d, title in zip(axes, drawn, ("time per step (s)", "tokens / s", "peak memory (GiB)")):
        if d:
            ax.set_title(title, fontsize=9)
    return _finish(fig, axes, drawn, "Timings, throughput, memory")


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward", "Reward and solve rate", plot_reward),
    PlotSpec("kl", "KL to reference and policy update", plot_kl),
    PlotSpec("loss", "Losses", plot_loss),
    PlotSpec("grad_norm", "Gradient norms", plot_grad_norm),
    PlotSpec("grad_layers", "Gradient norm per layer", plot_grad_layers),
    PlotSpec("exit", "Exit distribution over loops", plot_exit),
    PlotSpec("entropy", "Entropy per loop", plot_entropy),
    PlotSpec("compute", "Compute: exit steps, passes per token, goodput", plot_compute),
    PlotSpec("mismatch", "Sampler–learner log-prob mismatch", plot_mismatch),
    PlotSpec("lengths", "Completion lengths and truncation", plot_lengths),
    PlotSpec("timings", "Timings, throughput and memory", plot_timings),
)


def render_all(runs: Sequence[RunData], out_dir: str | Path,
               plots: Sequence[PlotSpec] = PLOTS) -> dict[str, Path]:
    """Draw every plot with data into ``out_dir/<name>.png``; returns name → path (in order)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for spec in plots:
        fig = spec.draw(runs)
        if fig is None:
            continue
        path = out / f"{spec.name}.png"
        fig.savefig(path, dpi=DPI)
        written[spec.name] = path
    return written
