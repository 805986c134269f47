"""Health checks over a run's metrics: each fires a :class:`Diagnosis` with its evidence.

Every check reads only the metric keys of :mod:`rltt.telemetry.schema`, stays silent when
those keys are absent or too few points were logged (a run that just started), and states
its evidence as *which metric, which steps, which statistic, which threshold*. The
thresholds are the module constants below; they come from the objectives and telemetry
sections of docs/design.md (§5, §6) and from measured runs.

Most "state" checks look at the *late window*: the last :data:`LATE_WINDOW_FRACTION` of the
logged points, so a problem that appeared late is caught and one that resolved itself is not
reported.

Besides the metrics, a check may read one setting of the run's resolved recipe
(``RUN_DIR/recipe.resolved.yaml``, when the run was loaded from its directory): the spike check
judges a gradient-norm spike against the gradient clipping the run trained with.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from rltt.telemetry import schema
from rltt.telemetry.metrics_file import METRICS_FILE, RESOLVED_RECIPE
from rltt.telemetry.series import RunData

# --------------------------------------------------------------------------- thresholds

#: Share of the logged points (the most recent ones) that state checks look at.
LATE_WINDOW_FRACTION = 0.5
#: A check needs at least this many points in its window, else it stays silent.
MIN_POINTS = 5

#: Policy not moving: the 90th percentile of kl/ref over the late window at or below this
#: (the quickstart at lr 1e-6 kept kl/ref ≈ 1e-5 over 40 steps; at 1e-5 it reached 8e-4) ...
KL_STUCK_MAX = 3e-4
#: ... once the run has logged kl/ref at least this many times.
KL_STUCK_MIN_STEPS = 20
#: An lr at or below this is reported as the likely cause (1e-6 stayed put; 1e-5 moved).
LR_LOW = 2e-6
#: The lr the action suggests.
LR_SUGGESTED = 1e-5
#: Median grad_norm/total at or below this counts as a small gradient.
GRAD_NORM_SMALL = 1e-2

#: Policy drifting too fast: median kl/ref over the late window above this (nats/token;
#: the quickstart collapsed at lr 1e-3 with KL > 2 and learned at lr 1e-4 with KL 0.05–0.14) ...
KL_DRIFT_MAX = 1.0
#: ... critical when the reward's late median also fell below its early median by this much.
REWARD_DROP_MIN = 0.05
#: Uniform groups: median groups/uniform_frac over the late window above this → warning ...
UNIFORM_GROUPS_WARN = 0.5
#: ... above this → critical (almost no group carries an advantage).
UNIFORM_GROUPS_CRITICAL = 0.9

#: Exit-gate collapse: mean exit/p_1 over the late window above this (with T ≥ 2), or the
#: same for exit/collapse when p_1 is not logged.
EXIT_COLLAPSE_P1 = 0.9

#: Exit collapse under a compute price (algorithm.compute_cost > 0, logged as reward/compute):
#: median compute/exit_entropy over the late window below this (nats; one step holding ~98 % of
#: the tokens of T = 4 loops gives about 0.1, an even spread log T = 1.39) ...
COMPUTE_EXIT_ENTROPY_MIN = 0.1
#: ... or, for a run that did not log it, the largest mean exit/p_t over the late window above
#: EXIT_COLLAPSE_P1.

#: Gradient vanishing across layers: median over steps of
#: grad_norm/layer/<first> / grad_norm/layer/<last> below this.
GRAD_LAYER_RATIO_MIN = 0.1

#: Spikes: the keys checked for upward outliers, each with the factor by which a point must
#: also exceed the trailing median (the scale-aware half of the test, see :func:`robust_spikes`).
#: Only positive quantities are checked: the LM loss, the gradient norm and the largest
#: importance ratio. The RL losses (``loss/policy``, ``loss/total``) are signed and hover
#: around zero — their level is set by the group-centred advantages, not by how well the
#: model fits — so a robust z-score of them means nothing; an unstable RL update shows in the
#: grad norm and the ratio instead (and a drifting policy in the KL, see check_policy_drift).
SPIKE_MIN_JUMP = {
    schema.LM_LOSS: 1.25,  # the LM loss 25 % above its recent level
    schema.GRAD_NORM_TOTAL: 3.0,  # the gradient norm 3× its recent level
    schema.POLICY_RATIO_MAX: 2.0,  # some token's probability doubled within one batch's updates
}
SPIKE_KEYS = tuple(SPIKE_MIN_JUMP)
#: Robust z-score above which a point is a spike: (x − median) / (1.4826·MAD) over the
#: trailing window of the previous points.
SPIKE_Z = 6.0
#: Trailing window length (points) for the median / MAD.
SPIKE_WINDOW = 20
#: Points of history needed before a point can be called a spike.
SPIKE_MIN_HISTORY = 8
#: The robust scale is at least this fraction of |median|, so a near-constant series does
#: not turn small wiggles into spikes.
SPIKE_REL_FLOOR = 0.02
#: A gradient-norm outlier (the test above) is only reported when it matters: when it is this many
#: times its trailing median (a real spike — healthy RL runs wander up to ~3× on single steps), or
#: when the reward fell / the LM loss rose after it (:func:`moved_after`). A spike the gradient
#: clipping bounded — the run's ``grad_clip`` below SPIKE_MIN_JUMP × the trailing median, so the
#: applied update was at most that many typical ones — is reported only when it is both.
GRAD_SPIKE_REAL_JUMP = 10.0
#: Points after a spike in which the reward (RL) or the LM loss is compared with its level before.
SPIKE_AFTER_POINTS = 3
#: The mean of those points must have moved the wrong way by this many robust standard errors
#: (1.4826·MAD of the trailing window / √points) ...
SPIKE_AFTER_Z = 3.0
#: ... and by at least this much: absolute for the reward, relative to its level for the LM loss.
SPIKE_AFTER_MIN_REWARD = 0.05
SPIKE_AFTER_MIN_LM_REL = 0.02
#: The resolved recipe keys holding the gradient clip (RL learner, LM stages); 0 = off.
GRAD_CLIP_KEYS = (("learner", "grad_clip"), ("optim", "grad_clip"))

#: Keys whose NaN/inf values are reported as critical.
FINITE_KEYS = (schema.LOSS_TOTAL, schema.LOSS_POLICY, schema.LM_LOSS, schema.GRAD_NORM_TOTAL,
               schema.KL_REF, schema.REWARD_MEAN)

#: Learner waiting (Ray orchestration): median orchestration/learner_idle_frac over the late
#: window above this — the learner waits for rollouts more than half of each step.
LEARNER_IDLE_MAX = 0.5
#: Rows dropped (orchestration.partial_rollouts): over the late window, dropped rows /
#: (dropped + trained rows) above this — most of the sampling is thrown away.
DROPPED_ROWS_MAX = 0.5

#: Sampler–learner mismatch: mismatch/max_abs above this ...
MISMATCH_MAX_ABS_MAX = 1e-2
#: ... or mismatch/k3 above this ...
MISMATCH_K3_MAX = 1e-3
#: ... at more than this fraction of the logged steps (at least one step) → warning;
#: at more than half of them → critical.
MISMATCH_MIN_FRACTION = 0.1

#: Rollout correction: median correction/masked_frac over the late window above this, and
#: above MASKED_GROWTH × its early median (the first quarter of the points) → warning ...
CORRECTION_MASKED_WARN = 0.02
MASKED_GROWTH = 2.0
#: ... above this, grown or not → critical (a fifth of every batch is thrown away).
CORRECTION_MASKED_CRITICAL = 0.2
#: Mismatch growing: a mismatch key's late median at least this many times its early median and
#: above MISMATCH_GROWTH_FLOOR × its limit of check_mismatch — a trend still under that limit
#: (above it, the log-prob mismatch check reports it).
MISMATCH_GROWTH = 4.0
MISMATCH_GROWTH_FLOOR = 0.1

#: Truncation: median length/trunc_frac over the late window above this.
TRUNC_FRAC_MAX = 0.2

#: Multi-turn episodes (env.name set): the tool is never called when the median of
#: env/tool_calls_mean over the late window is at or below this (episodes stay single-turn) ...
ENV_TOOL_CALLS_MIN = 0.01
#: ... and episodes run into their limits when the median env/truncated_frac over the late
#: window is above this; "the turn limit" when, besides, the median env/turns_mean reaches
#: ENV_TURN_LIMIT_SHARE × env.max_turns of the run's resolved recipe.
ENV_TRUNCATED_MAX = 0.5
ENV_TURN_LIMIT_SHARE = 0.9

#: Entropy collapse: median entropy of the last loop over the late window below this
#: (nats/token) ...
ENTROPY_COLLAPSE_MIN = 0.05
#: ... after having been at least this many times higher in the first points.
ENTROPY_COLLAPSE_DROP = 5.0


#: Updates lost to rounding: median sync/changed_frac over the late window below this (the
#: share of the trained elements whose value in the engines' dtype an update changed) ...
CHANGED_FRAC_MIN = 0.05
#: ... while the optimizer steps: the late median of grad_norm/total (when logged) above this.
GRAD_NORM_ZERO = 1e-8


# --------------------------------------------------------------------------- results


class Severity(str, enum.Enum):
    """How bad a diagnosis is; ``critical`` means the run is not training as intended."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return {"info": 0, "warning": 1, "critical": 2}[self.value]


@dataclass(frozen=True)
class Evidence:
    """One measurement behind a diagnosis: ``statistic(metric over steps) comparison threshold``."""

    metric: str
    steps: tuple[int, int]  # first and last step of the window examined
    statistic: str  # e.g. "median", "90th percentile", "max robust z"
    observed: float
    comparison: str  # "<", "<=", ">", ">="
    threshold: float
    points: tuple[int, ...] = ()  # individual steps flagged (spikes, errors), if any

    def describe(self) -> str:
        text = (f"{self.metric}: {self.statistic} {_fmt(self.observed)} {self.comparison} "
                f"{_fmt(self.threshold)} over steps {self.steps[0]}–{self.steps[1]}")
        if self.points:
            shown = ", ".join(str(p) for p in self.points[:10])
            more = f" (+{len(self.points) - 10} more)" if len(self.points) > 10 else ""
            text += f"; at steps {shown}{more}"
        return text


@dataclass(frozen=True)
class Diagnosis:
    """A finding about a run: what, how sure/bad, the evidence, and what to do."""

    id: str
    severity: Severity
    title: str
    evidence: tuple[Evidence, ...]
    action: str
    detail: str = ""

    def describe(self) -> str:
        lines = [f"[{self.severity.value}] {self.title} ({self.id})"]
        if self.detail:
            lines.append(f"  {self.detail}")
        lines += [f"  evidence: {e.describe()}" for e in self.evidence]
        lines.append(f"  action: {self.action}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Check:
    """A registered check: ``fn(run)`` returns a Diagnosis or None.

    ``requires``: the check can only run if the run logged at least one of these keys
    (templates allowed); used to list the checks a report could not make.
    """

    id: str
    title: str
    requires: tuple[str, ...]
    fn: Callable[[RunData], "Diagnosis | None"] = field(repr=False)

    def applicable(self, run: RunData) -> bool:
        keys = run.keys
        for req in self.requires:
            if "{" in req:
                if schema.indexed(keys, req) or schema.named(keys, req):
                    return True
            elif req in keys:
                return True
        return False


def _fmt(x: float) -> str:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x == 0 or 1e-3 <= abs(x) < 1e4:
        return f"{x:.4g}"
    return f"{x:.2e}"


# --------------------------------------------------------------------------- helpers


def _sci(x: float) -> str:
    """1e-05 → "1e-5"."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def late_window(steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The last :data:`LATE_WINDOW_FRACTION` of the points (at least MIN_POINTS when possible)."""
    n = len(values)
    k = max(MIN_POINTS, int(math.ceil(n * LATE_WINDOW_FRACTION)))
    return steps[-k:], values[-k:]


def _span(steps: np.ndarray) -> tuple[int, int]:
    return int(steps[0]), int(steps[-1])


@dataclass(frozen=True)
class LateMedian:
    """The median of one metric over its late window (`late_window`), what most checks test."""

    key: str
    median: float
    span: tuple[int, int]  # first and last step of the late window
    values: np.ndarray  # the whole series (its early points, its length)

    @property
    def early(self) -> float:
        """The median of the first quarter of the points (at least MIN_POINTS, `_early`)."""
        return float(np.median(_early(self.values)))

    def evidence(self, comparison: str, threshold: float, statistic: str = "median") -> Evidence:
        return Evidence(self.key, self.span, statistic, self.median, comparison, threshold)


def late_median(run: RunData, key: str, min_points: int = 1) -> LateMedian | None:
    """``key``'s late-window median, or None when the run logged fewer than ``min_points`` points of it."""
    steps, values = run.series(key)
    if len(values) < max(min_points, 1):
        return None
    window_steps, window = late_window(steps, values)
    return LateMedian(key, float(np.median(window)), _span(window_steps), values)


def robust_spikes(values: np.ndarray, z: float = SPIKE_Z, window: int = SPIKE_WINDOW,
                  min_history: int = SPIKE_MIN_HISTORY, rel_floor: float = SPIKE_REL_FLOOR,
                  min_jump: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Indices of upward outliers and their robust z-scores (trailing median / MAD).

    Point i is compared with the previous ``window`` points (needs ``min_history``):
    ``z_i = (x_i − median) / max(1.4826·MAD, rel_floor·|median|, 1e-12)``. Non-finite points
    are neither flagged (see the non-finite check) nor used as history.

    ``min_jump`` makes the test scale-aware, for positive quantities: the point must also be
    at least ``min_jump`` × the trailing median, and a point whose history holds a value
    <= 0 is never flagged (a series that reaches zero or changes sign has no level to
    jump from; a tiny MAD then turns ordinary noise into huge z-scores).
    """
    idx, scores = [], []
    for i in range(len(values)):
        x = values[i]
        if not math.isfinite(x):
            continue
        hist = values[max(0, i - window):i]
        hist = hist[np.isfinite(hist)]
        if len(hist) < min_history:
            continue
        med = float(np.median(hist))
        if min_jump is not None and (hist.min() <= 0 or x < min_jump * med):
            continue
        mad = float(np.median(np.abs(hist - med)))
        scale = max(1.4826 * mad, rel_floor * abs(med), 1e-12)
        score = (x - med) / scale
        if score > z:
            idx.append(i)
            scores.append(score)
    return np.array(idx, dtype=np.int64), np.array(scores, dtype=np.float64)


# --------------------------------------------------------------------------- checks


def check_policy_not_moving(run: RunData) -> Diagnosis | None:
    """KL to the reference stays at or below KL_STUCK_MAX over many steps: the policy is not moving."""
    steps, kl = run.series(schema.KL_REF)
    if len(kl) < KL_STUCK_MIN_STEPS:
        return None
    ws, wk = late_window(steps, kl)
    q90 = float(np.quantile(wk, 0.9))
    if q90 > KL_STUCK_MAX:
        return None
    evidence = [Evidence(schema.KL_REF, _span(ws), "90th percentile", q90, "<=", KL_STUCK_MAX)]
    causes = []
    for cause, key, limit in (("lr", schema.LR, LR_LOW), ("grad", schema.GRAD_NORM_TOTAL, GRAD_NORM_SMALL)):
        late = late_median(run, key)
        if late is not None and late.median <= limit:
            evidence.append(late.evidence("<=", limit))
            causes.append(cause)
    if "lr" in causes:
        action = (f"raise the learning rate (recipe key learner.lr), e.g. to {_sci(LR_SUGGESTED)}: the "
                  f"quickstart at lr 1e-6 kept KL ≈ 1e-5 and did not learn; at {_sci(LR_SUGGESTED)} "
                  "it moved the policy")
    elif "grad" in causes:
        action = ("the gradient is tiny: advantages are near zero — check uniform groups "
                  "(curate for mixed solve rate with `rltt curate`) and the reward functions")
    else:
        action = (f"raise the learning rate (e.g. {_sci(LR_SUGGESTED)}) or lower the KL "
                  "coefficient; check that the optimizer steps the policy's parameters")
    return Diagnosis(
        "policy_not_moving", Severity.WARNING, "Policy is not moving away from the reference",
        tuple(evidence), action,
        detail=f"KL to the reference stays at or below {KL_STUCK_MAX:g} nats/token "
               f"after {len(kl)} logged steps.")


def check_policy_drift(run: RunData) -> Diagnosis | None:
    """KL to the reference keeps growing past ~1 nat/token: the updates are too large, and the
    policy usually falls apart (entropy and lengths up, reward down)."""
    kl = late_median(run, schema.KL_REF, MIN_POINTS * 2)
    if kl is None or kl.median <= KL_DRIFT_MAX:
        return None
    evidence = [kl.evidence(">", KL_DRIFT_MAX)]
    severity = Severity.WARNING
    reward = late_median(run, schema.REWARD_MEAN, MIN_POINTS * 2)
    if reward is not None and reward.early - reward.median >= REWARD_DROP_MIN:
        evidence.append(reward.evidence("<", reward.early - REWARD_DROP_MIN))
        severity = Severity.CRITICAL
    return Diagnosis(
        "policy_drift", severity, "Policy is drifting too far from the reference", tuple(evidence),
        "lower the learning rate (÷3–10), or add a KL penalty (algorithm.kl_coef) / tighter clipping; "
        "the quickstart collapsed at lr 1e-3 (KL > 2) and gains +16 to +21 points in 250 steps at lr 1e-4",
        detail=f"KL to the reference is above {KL_DRIFT_MAX:g} nats/token late in the run"
               + (" and the reward fell." if severity is Severity.CRITICAL else "."))


def check_uniform_groups(run: RunData) -> Diagnosis | None:
    """Many groups have all-equal rewards: zero group-relative advantage, no learning signal."""
    uniform = late_median(run, schema.GROUPS_UNIFORM_FRAC, MIN_POINTS)
    if uniform is None or uniform.median <= UNIFORM_GROUPS_WARN:
        return None
    med = uniform.median
    severity = Severity.CRITICAL if med > UNIFORM_GROUPS_CRITICAL else Severity.WARNING
    threshold = UNIFORM_GROUPS_CRITICAL if severity is Severity.CRITICAL else UNIFORM_GROUPS_WARN
    evidence = [uniform.evidence(">", threshold)]
    solve = late_median(run, schema.SOLVE_RATE)
    detail = f"{med:.0%} of the groups carry zero advantage."
    if solve is not None:
        side = "too hard" if solve.median < 0.5 else "too easy"
        detail += f" Median solve rate {solve.median:.2f}: the prompts look {side}."
    return Diagnosis(
        "uniform_groups", severity, "Most groups have uniform rewards (zero advantage)",
        tuple(evidence),
        "curate the prompts for a mixed solve rate (`rltt curate`, band 0.1 ≤ s ≤ 0.9): RL "
        "learns from prompts the policy solves sometimes but not always, and prompts solved "
        "far more often than not teach little; or enable dynamic sampling "
        "(dynamic_sampling: true) to drop uniform groups and refill the batch",
        detail=detail)


def check_exit_collapse(run: RunData) -> Diagnosis | None:
    """The exit gate puts (almost) all its mass on loop 1: the model trains as a plain
    transformer."""
    loops = run.indexed(schema.EXIT_P)
    if len(loops) >= 2 and 1 in loops:
        key = loops[1]
        stat = "mean"
    elif run.has(schema.EXIT_COLLAPSE) and not loops:
        key = schema.EXIT_COLLAPSE
        stat = "mean"
    else:
        return None
    steps, values = run.series(key)
    if len(values) < MIN_POINTS:
        return None
    ws, wv = late_window(steps, values)
    mean = float(np.mean(wv))
    if mean <= EXIT_COLLAPSE_P1:
        return None
    # onset: first step after which the value stays above the threshold
    above = values > EXIT_COLLAPSE_P1
    onset_idx = len(above) - int(np.argmin(above[::-1])) if not above.all() else 0
    onset = int(steps[min(onset_idx, len(steps) - 1)])
    evidence = [Evidence(key, _span(ws), stat, mean, ">", EXIT_COLLAPSE_P1)]
    m_steps, mean_step = run.series(schema.EXIT_MEAN_STEP)
    detail = f"Exit mass on loop 1 has stayed above {EXIT_COLLAPSE_P1:g} since step {onset}."
    if len(mean_step):
        detail += f" Mean exit step at the end: {mean_step[-1]:.2f} of {len(loops) or '?'} loops."
    action = ("use a linear LR warmup (warmup_steps) and a larger exit-entropy coefficient "
              "β ≥ 0.10 (recipe key beta; the pretraining default is 0.15, docs/design.md §5.1); "
              "the LM loss does not show the collapse, the exit distribution does")
    if _priced(run) is not None:
        if check_compute_collapse(run) is not None:
            return None  # the recorded exits collapsed as well: the compute-price diagnosis says why
        detail += " The run trains under a compute price (reward/compute > 0)."
        action = "lower algorithm.compute_cost: the price on loops pushes the gate onto loop 1; " + action
    return Diagnosis(
        "exit_gate_collapse", Severity.CRITICAL, "Exit gate collapsed onto loop 1",
        tuple(evidence), action, detail=detail)


def _priced(run: RunData) -> tuple[np.ndarray, np.ndarray] | None:
    """The run's reward/compute series when it trained under a compute price (some value > 0)."""
    steps, price = run.series(schema.REWARD_COMPUTE)
    return (steps, price) if len(price) and float(np.max(price)) > 0 else None


def check_compute_collapse(run: RunData) -> Diagnosis | None:
    """Under a compute price the recorded exits collapsed onto one loop: every token runs the same
    number of loops, so the price is equal within every group and no longer carries a signal."""
    priced = _priced(run)
    if priced is None:
        return None
    evidence: list[Evidence] = []
    entropy = late_median(run, schema.COMPUTE_EXIT_ENTROPY, MIN_POINTS)
    loops = run.indexed(schema.EXIT_P)
    if entropy is not None:
        if entropy.median >= COMPUTE_EXIT_ENTROPY_MIN:
            return None
        evidence.append(entropy.evidence("<", COMPUTE_EXIT_ENTROPY_MIN))
    elif len(loops) >= 2:  # an older run: the gate's exit distribution
        late = {t: late_window(*run.series(key)) for t, key in loops.items()}
        if min(len(v) for _, v in late.values()) < MIN_POINTS:
            return None
        t_max = max(late, key=lambda t: float(np.mean(late[t][1])))
        top = float(np.mean(late[t_max][1]))
        if top <= EXIT_COLLAPSE_P1:
            return None
        evidence.append(Evidence(loops[t_max], _span(late[t_max][0]), "mean", top, ">", EXIT_COLLAPSE_P1))
    else:
        return None
    mean_exit = late_median(run, schema.COMPUTE_MEAN_EXIT)
    onto = f"loop {int(round(mean_exit.median))}" if mean_exit is not None else "one loop"
    price = late_median(run, schema.REWARD_COMPUTE)  # logged: the run is priced
    detail = (f"Under a compute price (reward/compute median {_fmt(price.median)} late) the tokens' exit "
              f"steps collapsed onto {onto}.")
    severity = Severity.WARNING
    reward = late_median(run, schema.REWARD_MEAN, MIN_POINTS * 2)
    if reward is not None and reward.early - reward.median >= REWARD_DROP_MIN:
        evidence.append(reward.evidence("<", reward.early - REWARD_DROP_MIN))
        severity = Severity.CRITICAL
        detail += " The task reward fell with it: the price outweighs what the loops earned."
    return Diagnosis(
        "compute_exit_collapse", severity, "Exit steps collapsed onto one loop under a compute price",
        tuple(evidence),
        "lower algorithm.compute_cost (λ·(T−1)/T is the most a completion can save; keep it well below the "
        "task reward's spread within a group) — or, with advantage_scale: group, set algorithm.compute_price: "
        "advantage: priced into the reward, a group whose task rewards tie gets its whole advantage from the "
        "price, normalised to unit size, whatever λ is — and resume from a checkpoint before the collapse — once every "
        "token exits at one step the price is equal within every group and the exits do not spread again on "
        "their own; compare eval/solve_rate with a λ = 0 run (or `rltt eval --exit-policy`) to see what the "
        "loops were worth",
        detail=detail)


def check_grad_vanishing(run: RunData) -> Diagnosis | None:
    """Per-layer grad norms of the first layer ≪ the last layer: gradient vanishes with depth."""
    layers = run.indexed(schema.GRAD_NORM_LAYER)
    if len(layers) < 2:
        return None
    first, last = min(layers), max(layers)
    s1, g1 = run.series(layers[first])
    s2, g2 = run.series(layers[last])
    common, i1, i2 = np.intersect1d(s1, s2, return_indices=True)
    if len(common) < MIN_POINTS:
        return None
    ratio = g1[i1] / np.maximum(g2[i2], 1e-30)
    med = float(np.median(ratio))
    if med >= GRAD_LAYER_RATIO_MIN:
        return None
    metric = f"{layers[first]} / {layers[last]}"
    return Diagnosis(
        "grad_vanishing_layers", Severity.WARNING, "Gradient vanishes across layers",
        (Evidence(metric, _span(common), "median ratio", med, "<", GRAD_LAYER_RATIO_MIN),),
        "check the norm placement: post-norm or sandwich norms attenuate the gradient "
        "reaching the first layers — use pre-norm (`norm_placement: pre`)",
        detail=f"Layer {first} receives {med:.1%} of the gradient norm of layer {last} "
               f"(median over {len(common)} steps).")


def grad_clip(run: RunData) -> float | None:
    """The gradient clip the run trained with, from ``RUN_DIR/recipe.resolved.yaml`` (None when the
    run was not loaded from a run directory, the file or key is missing, or clipping was off)."""
    for section, key in GRAD_CLIP_KEYS:
        value = _recipe_value(run, section, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value) if value > 0 else None
    return None


def moved_after(steps: np.ndarray, values: np.ndarray, step: int, worse: str,
                min_move: float) -> tuple[float, float, tuple[int, int]] | None:
    """Did a series move the wrong way after ``step``? ``worse``: "down" (a reward) or "up" (a loss).

    Compares the mean of the :data:`SPIKE_AFTER_POINTS` points after ``step`` with the median of
    the :data:`SPIKE_WINDOW` points before it: the move must exceed both ``min_move`` and
    :data:`SPIKE_AFTER_Z` robust standard errors (1.4826·MAD / √points). Returns (mean after,
    threshold, steps after) when it did, else None (also when too few points exist)."""
    before = values[(steps < step) & np.isfinite(values)][-SPIKE_WINDOW:]
    after_mask = steps > step
    after, after_steps = values[after_mask][:SPIKE_AFTER_POINTS], steps[after_mask][:SPIKE_AFTER_POINTS]
    if len(before) < SPIKE_MIN_HISTORY or len(after) < SPIKE_AFTER_POINTS or not np.isfinite(after).all():
        return None
    med = float(np.median(before))
    sigma = 1.4826 * float(np.median(np.abs(before - med)))
    margin = max(min_move, SPIKE_AFTER_Z * sigma / math.sqrt(len(after)))
    mean = float(after.mean())
    threshold = med - margin if worse == "down" else med + margin
    if (mean < threshold) if worse == "down" else (mean > threshold):
        return mean, threshold, (int(after_steps[0]), int(after_steps[-1]))
    return None


def _trailing_median(values: np.ndarray, i: int) -> float:
    hist = values[max(0, i - SPIKE_WINDOW):i]
    return float(np.median(hist[np.isfinite(hist)]))


def _consequence(run: RunData, step: int) -> Evidence | None:
    """The reward falling (RL) or the LM loss rising (LM stages) after ``step``, as evidence."""
    r_steps, reward = run.series(schema.REWARD_MEAN)
    if len(reward):
        moved = moved_after(r_steps, reward, step, "down", SPIKE_AFTER_MIN_REWARD)
        key, comparison = schema.REWARD_MEAN, "<"
    else:
        l_steps, loss = run.series(schema.LM_LOSS)
        if not len(loss):
            return None
        level = float(np.median(loss[l_steps < step][-SPIKE_WINDOW:])) if (l_steps < step).any() else 0.0
        moved = moved_after(l_steps, loss, step, "up", SPIKE_AFTER_MIN_LM_REL * abs(level))
        key, comparison = schema.LM_LOSS, ">"
    if moved is None:
        return None
    mean, threshold, span = moved
    return Evidence(key, span, f"mean of the {SPIKE_AFTER_POINTS} points after step {step}", mean, comparison,
                    threshold)


def check_spikes(run: RunData) -> Diagnosis | None:
    """Upward outliers that call for action: of the LM loss or the largest importance ratio, a
    robust z-score over a trailing window *and* a jump relative to the series' level; of the
    gradient norm, such an outlier that is also large (≥ :data:`GRAD_SPIKE_REAL_JUMP` × its level)
    or followed by a falling reward / rising LM loss — and, when the gradient clipping bounded the
    update, both. Signed RL losses are not checked (see :data:`SPIKE_MIN_JUMP`)."""
    evidence, consequences, notes = [], [], []
    clip = grad_clip(run)
    for key, jump in SPIKE_MIN_JUMP.items():
        steps, values = run.series(key)
        if len(values) < SPIKE_MIN_HISTORY + 1:
            continue
        idx, scores = robust_spikes(values, min_jump=jump)
        statistic = f"max robust z (points also ≥ {jump:g}× the trailing median)"
        if key == schema.GRAD_NORM_TOTAL and len(idx):
            real = []
            for i in idx:
                level = _trailing_median(values, int(i))
                large = values[i] >= GRAD_SPIKE_REAL_JUMP * level
                bounded = clip is not None and clip < jump * level
                after = _consequence(run, int(steps[i]))
                if (large and after is not None) or (not bounded and (large or after is not None)):
                    real.append(i)
                    if after is not None:
                        consequences.append(after)
            keep = np.isin(idx, real)
            idx, scores = idx[keep], scores[keep]
            statistic = (f"max robust z (points ≥ {GRAD_SPIKE_REAL_JUMP:g}× the trailing median or followed by "
                         "a falling reward / rising loss)")
            if len(idx) and clip is not None:
                notes.append(f"Gradients were clipped at {clip:g} (grad_norm/total is logged before clipping).")
        if len(idx):
            evidence.append(Evidence(key, _span(steps), statistic, float(scores.max()), ">", SPIKE_Z,
                                     points=tuple(int(s) for s in steps[idx])))
    if not evidence:
        return None
    return Diagnosis(
        "spikes", Severity.WARNING, "Loss, gradient-norm or importance-ratio spikes",
        tuple(evidence + consequences),
        "inspect the batches at the flagged steps (rewards, completion lengths); lower the "
        "learning rate or tighten gradient clipping (recipe key grad_clip); in RL a ratio spike "
        "with several updates per batch (ppo_epochs > 1) calls for fewer updates or tighter "
        "clipping (eps_low / eps_high)",
        detail=" ".join(["Points far above the median of the preceding steps, both in robust z-score "
                         "and relative to that median."] + notes))


def check_non_finite(run: RunData) -> Diagnosis | None:
    """NaN or inf in a loss, the grad norm, the KL or the reward."""
    evidence = []
    for key in FINITE_KEYS:
        steps, values = run.series(key, finite=False)
        bad = ~np.isfinite(values)
        if bad.any():
            evidence.append(Evidence(key, _span(steps), "non-finite values", float(bad.sum()),
                                     ">", 0.0, points=tuple(int(s) for s in steps[bad])))
    if not evidence:
        return None
    return Diagnosis(
        "non_finite", Severity.CRITICAL, "NaN or inf in the training signal", tuple(evidence),
        "resume from the last checkpoint before the first flagged step with a lower learning "
        "rate or gradient clipping; in bf16 check the per-loop log-prob kernel and the loss "
        "reductions")


def _mismatch_out_of_range(values: np.ndarray, limit: float) -> bool:
    """Above ``limit`` at more than MISMATCH_MIN_FRACTION of the steps (at least one)."""
    needed = max(1, int(math.ceil(MISMATCH_MIN_FRACTION * len(values))))
    return int((values > limit).sum()) >= needed


def check_mismatch(run: RunData) -> Diagnosis | None:
    """The sampler's and the learner's log-probs of the same tokens disagree (docs/design.md
    §3.4)."""
    evidence = []
    worst_fraction = 0.0
    for key, limit in ((schema.MISMATCH_MAX_ABS, MISMATCH_MAX_ABS_MAX),
                       (schema.MISMATCH_K3, MISMATCH_K3_MAX)):
        steps, values = run.series(key)
        if not len(values):
            continue
        over = values > limit
        if _mismatch_out_of_range(values, limit):
            worst_fraction = max(worst_fraction, float(over.mean()))
            evidence.append(Evidence(key, _span(steps), "max", float(values.max()), ">", limit,
                                     points=tuple(int(s) for s in steps[over])))
    if not evidence:
        return None
    severity = Severity.CRITICAL if worst_fraction > 0.5 else Severity.WARNING
    return Diagnosis(
        "logprob_mismatch", severity, "Sampler–learner log-prob mismatch out of range",
        tuple(evidence),
        "the learner does not score what the sampler sampled: check schedule replay (recorded "
        "exit steps t*), the log-prob definition (policy_logprob) and temperature on both sides, "
        "dtype (bf16 vs fp32) and that weights were synced; use the hybrid log-prob or the "
        "truncated importance-sampling correction",
        detail=f"Out of range at {worst_fraction:.0%} of the logged steps.")


def _early(values: np.ndarray) -> np.ndarray:
    """The first quarter of the points (at least MIN_POINTS)."""
    return values[:max(MIN_POINTS, len(values) // 4)]


def check_mismatch_growing(run: RunData) -> Diagnosis | None:
    """The rollout correction masks a growing (or large) share of the tokens, or the sampler–learner
    mismatch grows during the run while still under the log-prob mismatch check's limits
    (docs/design.md §3.4, §5.6): the sampler drifts away from the learner."""
    evidence, severity = [], Severity.WARNING
    masked = late_median(run, schema.CORRECTION_MASKED_FRAC, 2 * MIN_POINTS)
    if masked is not None:
        growth = max(CORRECTION_MASKED_WARN, MASKED_GROWTH * masked.early)
        if masked.median > CORRECTION_MASKED_CRITICAL:
            severity = Severity.CRITICAL
            evidence.append(masked.evidence(">", CORRECTION_MASKED_CRITICAL))
        elif masked.median > growth:
            evidence.append(masked.evidence(">", growth, f"median (early median {_fmt(masked.early)})"))
    for key, limit in ((schema.MISMATCH_MAX_ABS, MISMATCH_MAX_ABS_MAX), (schema.MISMATCH_K3, MISMATCH_K3_MAX)):
        mismatch = late_median(run, key, 2 * MIN_POINTS)
        if mismatch is None:
            continue
        threshold = max(MISMATCH_GROWTH_FLOOR * limit, MISMATCH_GROWTH * mismatch.early)
        if mismatch.median > threshold and not _mismatch_out_of_range(mismatch.values, limit):  # else check_mismatch
            evidence.append(mismatch.evidence(">", threshold, f"median (early median {_fmt(mismatch.early)})"))
    if not evidence:
        return None
    actions = []
    if any(e.metric != schema.CORRECTION_MASKED_FRAC for e in evidence):
        actions.append("the sampler is drifting away from the learner: check that the weights reach the engines "
                       "every step (orchestration/staleness, time/weight_sync), that both sides use the same "
                       "LM-head dtype and temperature, and the recorded exit steps")
    if any(e.metric == schema.CORRECTION_MASKED_FRAC for e in evidence):
        actions.append("a masked token teaches nothing, so a growing masked share shrinks every update: find why "
                       "the sampler diverges before widening the band (algorithm.correction_lo / correction_hi); "
                       "a sequence-level correction (seq_tis, geo_mask) is less sensitive to per-token noise")
    return Diagnosis(
        "mismatch_growing", severity, "Sampler–learner mismatch growing", tuple(evidence), "; ".join(actions),
        detail="Compared: the late window's median with the median of the first quarter of the steps.")


def check_reward_errors(run: RunData) -> Diagnosis | None:
    """A reward function raised for some completions (they were scored 0)."""
    steps, errors = run.series(schema.REWARD_ERRORS)
    if not len(errors) or errors.sum() <= 0:
        return None
    flagged = steps[errors > 0]
    return Diagnosis(
        "reward_errors", Severity.WARNING, "Reward functions raised errors",
        (Evidence(schema.REWARD_ERRORS, _span(steps), "total", float(errors.sum()), ">", 0.0,
                  points=tuple(int(s) for s in flagged)),),
        "fix the reward function: those completions were scored 0, which biases the "
        "advantages; the run log names the exception",
        detail=f"Errors at {len(flagged)} of {len(steps)} steps.")


def check_truncation(run: RunData) -> Diagnosis | None:
    """Many completions hit max_new_tokens."""
    truncated = late_median(run, schema.LENGTH_TRUNC_FRAC, MIN_POINTS)
    if truncated is None or truncated.median <= TRUNC_FRAC_MAX:
        return None
    med = truncated.median
    return Diagnosis(
        "truncation", Severity.WARNING, "Many completions are truncated",
        (truncated.evidence(">", TRUNC_FRAC_MAX),),
        "raise max_new_tokens, or add a format/length reward; truncated completions usually "
        "score 0 and a rising truncation rate often precedes a collapse",
        detail=f"{med:.0%} of the completions end at the length limit.")


def check_tools_unused(run: RunData) -> Diagnosis | None:
    """Multi-turn episodes whose policy never calls the tool: every episode is one turn."""
    calls = late_median(run, schema.ENV_TOOL_CALLS_MEAN, MIN_POINTS)
    if calls is None or calls.median > ENV_TOOL_CALLS_MIN:
        return None
    return Diagnosis(
        "tools_unused", Severity.WARNING, "The policy never calls the tool",
        (calls.evidence("<=", ENV_TOOL_CALLS_MIN),),
        "show the call syntax in the prompt (data.system_prompt or data.prompt_template) and check that "
        "env.stop_strings matches it; a policy that never calls cannot learn from the tool",
        detail="Every episode ended at its first turn: the run trains as a single-turn one.")


def _recipe_value(run: RunData, section: str, key: str):
    """``section.key`` of the run's ``RUN_DIR/recipe.resolved.yaml`` (None when not known)."""
    if not (run.path / METRICS_FILE).is_file() or not (run.path / RESOLVED_RECIPE).is_file():
        return None
    try:
        import yaml

        recipe = yaml.safe_load((run.path / RESOLVED_RECIPE).read_text(encoding="utf-8")) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return None
    part = recipe.get(section)
    return part.get(key) if isinstance(part, dict) else None


def check_turn_limit(run: RunData) -> Diagnosis | None:
    """Most multi-turn episodes end cut by env.max_turns / env.max_tokens, not by a final answer."""
    truncated = late_median(run, schema.ENV_TRUNCATED_FRAC, MIN_POINTS)
    if truncated is None or truncated.median <= ENV_TRUNCATED_MAX:
        return None
    med = truncated.median
    evidence = [truncated.evidence(">", ENV_TRUNCATED_MAX)]
    max_turns = _recipe_value(run, "env", "max_turns")
    turns = late_median(run, schema.ENV_TURNS_MEAN)
    at_turns = False
    if isinstance(max_turns, int) and turns is not None:
        at_turns = turns.median >= ENV_TURN_LIMIT_SHARE * max_turns
        if at_turns:
            evidence.append(turns.evidence(">=", ENV_TURN_LIMIT_SHARE * max_turns))
    title = "Episodes run to the turn limit" if at_turns else "Episodes are cut by their limits"
    return Diagnosis(
        "turn_limit", Severity.WARNING, title, tuple(evidence),
        "raise env.max_turns (or env.max_tokens), or reward a final answer: a cut episode's last turn "
        "still calls a tool, so it is scored without an answer and usually gets 0",
        detail=f"{med:.0%} of the episodes end truncated.")


def check_entropy_collapse(run: RunData) -> Diagnosis | None:
    """The policy's token entropy (last loop) collapsed towards zero."""
    loops = run.indexed(schema.ENTROPY_LOOP)
    if not loops:
        return None
    entropy = late_median(run, loops[max(loops)], 2 * MIN_POINTS)
    if entropy is None:
        return None
    late = entropy.median
    early = float(np.median(entropy.values[:MIN_POINTS]))  # the very first steps, not `LateMedian.early`
    if late >= ENTROPY_COLLAPSE_MIN or early < ENTROPY_COLLAPSE_DROP * max(late, 1e-12):
        return None
    return Diagnosis(
        "entropy_collapse", Severity.WARNING, "Policy entropy collapsed", (
            entropy.evidence("<", ENTROPY_COLLAPSE_MIN),
        ),
        "exploration is gone: use clip-higher (a larger ε_high), lower the learning rate, "
        "raise the sampling temperature, or add an entropy bonus",
        detail=f"Entropy fell from {early:.3g} (first steps) to {late:.3g} nats/token.")


def check_learner_waiting(run: RunData) -> Diagnosis | None:
    """The learner (a Ray run's learner group) ran no update for more than half of each step: it
    waits for rollouts."""
    idle = late_median(run, schema.ORCH_LEARNER_IDLE_FRAC, MIN_POINTS)
    if idle is None or idle.median <= LEARNER_IDLE_MAX:
        return None
    med = idle.median
    return Diagnosis(
        "learner_waiting", Severity.WARNING, "The learner waits for rollouts most of the time",
        (idle.evidence(">", LEARNER_IDLE_MAX),),
        "sample ahead of the learner: raise orchestration.max_staleness (K steps sampled while the learner "
        "updates); for long-tail completion lengths set orchestration.partial_rollouts: true so a long row no "
        "longer holds its step back; or add rollout workers (orchestration.ray.rollout_workers)",
        detail=f"The learner ran no update for {med:.0%} of a step's wall time (median).")


def check_rows_dropped(run: RunData) -> Diagnosis | None:
    """Partial rollouts drop most rows: their groups fell more than max_staleness versions behind."""
    steps, dropped = run.series(schema.ORCH_DROPPED_ROWS)
    if len(dropped) < MIN_POINTS:
        return None
    ws, wd = late_window(steps, dropped)
    s_steps, rows = run.series(schema.ROLLOUT_SEQUENCES)
    trained = float(rows[np.isin(s_steps, ws)].sum())
    total = float(wd.sum()) + trained
    frac = float(wd.sum()) / total if total > 0 else 0.0
    if frac <= DROPPED_ROWS_MAX:
        return None
    return Diagnosis(
        "rows_dropped", Severity.WARNING, "Most sampled rows are dropped as too stale",
        (Evidence(schema.ORCH_DROPPED_ROWS, _span(ws), "dropped / (dropped + rollout/sequences)", frac, ">",
                  DROPPED_ROWS_MAX),),
        "raise orchestration.max_staleness so a row may span more weights versions, lower rollout.max_new_tokens "
        "(the long rows are the ones dropped), or add rollout workers (orchestration.ray.rollout_workers) so rows "
        "finish within fewer updates",
        detail=f"{frac:.0%} of the rows sampled in the late window were dropped, never trained on.")


def check_rounding_lost(run: RunData) -> Diagnosis | None:
    """The weights the engines receive barely change from step to step while the optimizer steps:
    a 16-bit weight is its fp32 master rounded to nearest, so a change below half an ulp
    (2⁻⁹ of the weight for bf16) does not reach the engines until it accumulates past it."""
    changed = late_median(run, schema.SYNC_CHANGED_FRAC, MIN_POINTS)
    if changed is None or changed.median >= CHANGED_FRAC_MIN:
        return None
    evidence = [changed.evidence("<", CHANGED_FRAC_MIN)]
    grad = late_median(run, schema.GRAD_NORM_TOTAL)
    if grad is not None:
        if grad.median <= GRAD_NORM_ZERO:  # no gradient: nothing to lose (another check's finding)
            return None
        evidence.append(grad.evidence(">", GRAD_NORM_ZERO))
    lr = late_median(run, schema.LR)
    dtype = _recipe_value(run, "learner", "dtype")
    actions = [f"raise the learning rate (learner.lr{f', now {_sci(lr.median)}' if lr is not None else ''}) so one "
               "step moves a weight by more than half an ulp of the engines' dtype"]
    if dtype != "fp32":
        backend = _recipe_value(run, "learner", "backend")
        if backend in (None, "torch") and _recipe_value(run, "learner", "rounding") != "stochastic":
            actions.append("or round the masters stochastically (learner.rounding: stochastic: a change below half "
                           "an ulp then moves the weight with the matching probability)")
        actions.append("or train in fp32 (learner.dtype: fp32; the engines then sample in fp32 too)")
    return Diagnosis(
        "rounding_lost", Severity.WARNING, "Updates lost to rounding: the engines' weights barely change",
        tuple(evidence), "; ".join(actions),
        detail=f"A median {changed.median:.1%} of the trained elements changed per update in the engines' dtype: "
               f"the learner's masters move, the weights the engines sample with stay put.")


CHECKS: tuple[Check, ...] = (
    Check("non_finite", "NaN/inf in the training signal", FINITE_KEYS, check_non_finite),
    Check("policy_not_moving", "policy not moving", (schema.KL_REF,), check_policy_not_moving),
    Check("policy_drift", "policy drifting too far", (schema.KL_REF,), check_policy_drift),
    Check("uniform_groups", "uniform groups", (schema.GROUPS_UNIFORM_FRAC,), check_uniform_groups),
    Check("exit_gate_collapse", "exit-gate collapse", (schema.EXIT_P, schema.EXIT_COLLAPSE),
          check_exit_collapse),
    Check("compute_exit_collapse", "exit collapse under a compute price",  # a run without a price: nothing to report
          (schema.COMPUTE_EXIT_ENTROPY, schema.EXIT_P), check_compute_collapse),
    Check("grad_vanishing_layers", "gradient vanishing across layers",
          (schema.GRAD_NORM_LAYER,), check_grad_vanishing),
    Check("spikes", "loss / grad-norm spikes", SPIKE_KEYS, check_spikes),
    Check("rounding_lost", "updates lost to rounding", (schema.SYNC_CHANGED_FRAC,), check_rounding_lost),
    Check("logprob_mismatch", "sampler–learner log-prob mismatch",
          (schema.MISMATCH_MAX_ABS, schema.MISMATCH_K3), check_mismatch),
    Check("mismatch_growing", "mismatch or masked share growing",
          (schema.CORRECTION_MASKED_FRAC, schema.MISMATCH_MAX_ABS, schema.MISMATCH_K3), check_mismatch_growing),
    Check("reward_errors", "reward errors", (schema.REWARD_ERRORS,), check_reward_errors),
    Check("truncation", "truncation", (schema.LENGTH_TRUNC_FRAC,), check_truncation),
    Check("entropy_collapse", "entropy collapse", (schema.ENTROPY_LOOP,), check_entropy_collapse),
    # a single-turn RL run (reward/mean, no env/*) has no episodes to find anything in
    Check("tools_unused", "tools never called", (schema.ENV_TOOL_CALLS_MEAN, schema.REWARD_MEAN), check_tools_unused),
    Check("turn_limit", "episodes at the turn limit", (schema.ENV_TRUNCATED_FRAC, schema.REWARD_MEAN),
          check_turn_limit),
    # an RL run without these metrics has nothing to find: one process alternates sampling and updates,
    # and only partial rollouts drop rows — so any RL run (reward/mean) counts as checked
    Check("learner_waiting", "learner waiting for rollouts", (schema.ORCH_LEARNER_IDLE_FRAC, schema.REWARD_MEAN),
          check_learner_waiting),
    Check("rows_dropped", "rows dropped as too stale", (schema.ORCH_DROPPED_ROWS, schema.REWARD_MEAN),
          check_rows_dropped),
)


def diagnose(run: RunData, checks: tuple[Check, ...] = CHECKS) -> list[Diagnosis]:
    """Run the checks; the diagnoses that fired, most severe first (stable otherwise)."""
    found = [d for check in checks if (d := check.fn(run)) is not None]
    return sorted(found, key=lambda d: -d.severity.rank)


def unchecked(run: RunData, checks: tuple[Check, ...] = CHECKS) -> list[Check]:
    """The checks this run's metrics cannot feed (none of their keys was logged)."""
    return [c for c in checks if not c.applicable(run)]
