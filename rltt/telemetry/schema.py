"""The metric vocabulary shared by the training loops, the logger and ``rltt review``.

Every record in ``RUN_DIR/metrics.jsonl`` is one flat JSON object: ``step`` plus any of the
keys below. Keys are grouped with ``/`` (``reward/mean``, ``grad_norm/layer/3``), which is
also how TensorBoard and W&B group them.

Conventions
-----------
- ``step`` is the global optimizer step (one RL step = one rollout batch + its updates; one
  LM step = one optimizer update). It increases monotonically within a run.
- A key that was not measured at a step is *absent* from that step's record; never log a
  placeholder 0 (the review treats absent and measured-zero differently).
- Token-level quantities are means over completion tokens (prompt and padding masked out)
  unless the table says otherwise.
- Loop indices ``t`` are 1-based (``t = 1..T``, as in docs/design.md §1); layer indices ``i``
  are 0-based, matching the parameter names ``model.layers.<i>.*``.
- ``eval/...`` keys are measured on held-out data at the steps the loop evaluates (an RL run
  also logs them at step 0, before the first update).
- Log-probs and KLs are in nats; times in seconds; memory in GiB (2**30 bytes).

Keys with a placeholder (``reward/{fn}``, ``exit/p_{t}``, ...) are templates; build them with
the helper functions (:func:`reward_key`, :func:`exit_p_key`, ...) and recognise them with
:func:`lookup` / :func:`indexed`.

Strict mode: :class:`rltt.telemetry.logger.MetricsLogger` rejects a key this module does not
document when constructed with ``strict=True``, or when the environment variable
``RLTT_STRICT_METRICS=1`` is set (the test suite sets it, so every loop test checks that
what it logs is registered here). A loop that logs a new key adds it to :data:`METRICS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

GIB = 1 << 30  # bytes in a GiB, the unit of every memory figure rltt reports and plans

# --------------------------------------------------------------------------- fixed keys

STEP = "step"
WALL_TIME = "wall_time"

REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
REWARD_ERRORS = "reward/errors"
REWARD_COMPUTE = "reward/compute"
SOLVE_RATE = "solve_rate"
GROUPS_UNIFORM_FRAC = "groups/uniform_frac"

KL_REF = "kl/ref"
LOSS_POLICY = "loss/policy"
LOSS_KL = "loss/kl"
LOSS_TOTAL = "loss/total"
POLICY_CLIP_FRAC = "policy/clip_frac"
POLICY_RATIO_MEAN = "policy/ratio_mean"
POLICY_RATIO_MAX = "policy/ratio_max"
POLICY_RATIO_MIN = "policy/ratio_min"

GRAD_NORM_TOTAL = "grad_norm/total"

# what leaves the learner
SYNC_CHANGED_FRAC = "sync/changed_frac"

EXIT_MEAN_STEP = "exit/mean_step"
EXIT_COLLAPSE = "exit/collapse"
EXIT_ENTROPY = "exit/entropy"

MISMATCH_MAX_ABS = "mismatch/max_abs"
MISMATCH_MEAN_ABS = "mismatch/mean_abs"
MISMATCH_K3 = "mismatch/k3"

# rollout correction (algorithm.correction; logged only when one is set)
CORRECTION_MASKED_FRAC = "correction/masked_frac"
CORRECTION_WEIGHT_MEAN = "correction/weight_mean"
CORRECTION_WEIGHT_MAX = "correction/weight_max"

LENGTH_MEAN = "length/mean"
LENGTH_MAX = "length/max"
LENGTH_TRUNC_FRAC = "length/trunc_frac"
LENGTH_FORCED_FRAC = "length/forced_frac"
LENGTH_THINK_MEAN = "length/think_mean"
LENGTH_ANSWER_MEAN = "length/answer_mean"
LENGTH_UNCLOSED_FRAC = "length/unclosed_frac"

TIME_ROLLOUT = "time/rollout"
TIME_LEARNER = "time/learner"
TIME_WEIGHT_SYNC = "time/weight_sync"
TIME_STEP = "time/step"
THROUGHPUT_TOKENS_PER_S = "throughput/tokens_per_s"
THROUGHPUT_GOODPUT = "throughput/goodput"
MEMORY_PEAK_GB = "memory/peak_gb"
LR = "lr"

LM_LOSS = "lm/loss"

# compute: how many loops the rollout's tokens ran (recorded exits, serial passes)
COMPUTE_MEAN_EXIT = "compute/mean_exit"
COMPUTE_PASSES_PER_TOKEN = "compute/passes_per_token"
COMPUTE_EXIT_ENTROPY = "compute/exit_entropy"

# rollout (engine) statistics of the RL loop
ROLLOUT_SEQUENCES = "rollout/sequences"
ROLLOUT_REFILLS = "rollout/refills"
ROLLOUT_OCCUPANCY = "rollout/occupancy"
ROLLOUT_OCCUPANCY_WAITING = "rollout/occupancy_waiting"
# multi-turn episodes (env.name set; docs/environments.md)
ENV_TURNS_MEAN = "env/turns_mean"
ENV_TOOL_CALLS_MEAN = "env/tool_calls_mean"
ENV_TOOL_USE_FRAC = "env/tool_use_frac"
ENV_TOOL_ERRORS = "env/tool_errors"
ENV_TRUNCATED_FRAC = "env/truncated_frac"
ENV_REWARD_MEAN = "env/reward_mean"
ENV_ERRORS = "env/errors"
# Ray orchestration (orchestration.backend=ray)
ORCH_STALENESS = "orchestration/staleness"
ORCH_STALENESS_MEAN = "orchestration/staleness_mean"
ORCH_OVERLAP_SAVED_S = "orchestration/overlap_saved_s"
ORCH_WORKER_RESTARTS = "orchestration/worker_restarts"
ORCH_REISSUED_SHARDS = "orchestration/reissued_shards"
ORCH_DROPPED_ROWS = "orchestration/dropped_rows"
ORCH_PARTIAL_ROWS = "orchestration/partial_rows"
ORCH_LEARNER_IDLE_FRAC = "orchestration/learner_idle_frac"
ORCH_ROLLOUT_IDLE_FRAC = "orchestration/rollout_idle_frac"

# held-out evaluation: RL loop and LM stages
EVAL_SOLVE_RATE = "eval/solve_rate"
EVAL_REWARD_MEAN = "eval/reward_mean"
EVAL_COMPUTE_MEAN_EXIT = "eval/compute/mean_exit"
EVAL_COMPUTE_PASSES_PER_TOKEN = "eval/compute/passes_per_token"
EVAL_LM_LOSS = "eval/lm_loss"
EVAL_COMPLETION_LENGTH = "eval/completion_length"
EVAL_EXIT_MEAN_STEP = "eval/exit/mean_step"
EVAL_EXIT_COLLAPSE = "eval/exit/collapse"
EVAL_EXIT_ENTROPY = "eval/exit/entropy"

#: Prefix of the held-out evaluation keys.
EVAL_PREFIX = "eval/"

#: Keys older runs logged under another name: former name -> current one. Reading a metrics file
#: (`rltt.telemetry.read_metrics`, `RunData.load`) gives them their current names, so an older
#: run reviews, plots and compares like a new one; no loop logs the former names.
RENAMED: dict[str, str] = {
    "rollout/exit_step_mean": COMPUTE_MEAN_EXIT,
    "rollout/passes_per_token": COMPUTE_PASSES_PER_TOKEN,
    "eval/exit_step_mean": EVAL_COMPUTE_MEAN_EXIT,
}


def current_names(record: Mapping[str, object]) -> dict[str, object]:
    """``record`` with the keys of :data:`RENAMED` under their current names (a current name
    already present wins)."""
    out = dict(record)
    for old, new in RENAMED.items():
        if old in out:
            value = out.pop(old)
            out.setdefault(new, value)
    return out

# --------------------------------------------------------------------------- templates

REWARD_FN = "reward/{fn}"
REWARD_ERRORS_FN = "reward/errors/{fn}"
GUARD_SKIPPED_STEPS = "guard/skipped_steps"
GRAD_NORM_GROUP = "grad_norm/group/{name}"
GRAD_NORM_LAYER = "grad_norm/layer/{i}"
LORA_A_NORM = "lora/A_norm/{name}"
LORA_B_NORM = "lora/B_norm/{name}"
LORA_UPDATE_NORM = "lora/update_norm/{name}"
ENTROPY_LOOP = "entropy/loop_{t}"
EXIT_P = "exit/p_{t}"
LM_LOSS_STEP = "lm/loss_step_{t}"
EVAL_LM_LOSS_STEP = "eval/lm_loss_step_{t}"
EVAL_EXIT_P = "eval/exit/p_{t}"


def reward_key(fn: str) -> str:
    """``reward/<fn>``: mean reward of one reward function (e.g. ``reward/gsm8k_strict``)."""
    if fn in _RESERVED_REWARD_NAMES:
        raise ValueError(f"reward function name {fn!r} clashes with metric reward/{fn}")
    return REWARD_FN.format(fn=fn)


def reward_errors_key(fn: str) -> str:
    """``reward/errors/<fn>``: completions one reward function failed on (scored 0)."""
    return REWARD_ERRORS_FN.format(fn=fn)


def grad_group_key(name: str) -> str:
    """``grad_norm/group/<name>``: L2 norm of the gradients of one module group."""
    return GRAD_NORM_GROUP.format(name=name)


def grad_layer_key(i: int) -> str:
    """``grad_norm/layer/<i>``: L2 norm of the gradients of shared-block layer ``i`` (0-based)."""
    return GRAD_NORM_LAYER.format(i=int(i))


def entropy_key(t: int) -> str:
    """``entropy/loop_<t>``: mean token entropy of the step-t distribution P^(t) (t 1-based)."""
    return ENTROPY_LOOP.format(t=_loop(t))


def exit_p_key(t: int) -> str:
    """``exit/p_<t>``: mean exit probability p_t of loop t (t 1-based)."""
    return EXIT_P.format(t=_loop(t))


def lm_loss_step_key(t: int) -> str:
    """``lm/loss_step_<t>``: LM cross-entropy L_t of the step-t distribution (t 1-based)."""
    return LM_LOSS_STEP.format(t=_loop(t))


def eval_key(key: str) -> str:
    """``eval/<key>``: a training key measured on held-out data (``eval/exit/p_2``,
    ``eval/lm_loss_step_1``). Raises ValueError when the result is not in the vocabulary."""
    full = key if key.startswith(EVAL_PREFIX) else EVAL_PREFIX + key
    if lookup(full) is None:
        raise ValueError(f"{full!r} is not a documented held-out metric (rltt.telemetry.schema)")
    return full


def _loop(t: int) -> int:
    t = int(t)
    if t < 1:
        raise ValueError(f"loop index t is 1-based, got {t}")
    return t


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class MetricSpec:
    """One entry of the vocabulary.

    ``key`` is a literal key or a template with one ``{placeholder}``; ``stage`` says which
    loops log it: ``"rl"`` (RL post-training), ``"lm"`` (pretrain / convert) or ``"all"``.
    """

    key: str
    meaning: str
    unit: str
    stage: str = "rl"

    @property
    def is_template(self) -> bool:
        return "{" in self.key

    @property
    def group(self) -> str:
        """The part before the first ``/`` (the whole key when there is none)."""
        return self.key.split("/", 1)[0]


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(STEP, "global optimizer step of the record", "step", "all"),
    MetricSpec(WALL_TIME, "time the record was written (added by MetricsLogger)", "unix s", "all"),
    # rewards and task signal
    MetricSpec(REWARD_MEAN, "mean total reward over the step's completions", "reward"),
    MetricSpec(REWARD_STD, "std of the total reward over the step's completions", "reward"),
    MetricSpec(REWARD_FN, "mean reward of one reward function (unweighted)", "reward"),
    MetricSpec(REWARD_ERRORS, "completions whose reward function raised (scored 0)", "count"),
    MetricSpec(REWARD_COMPUTE,
               "mean compute penalty algorithm.compute_cost * (mean recorded exit step t* of a completion's "
               "sampled tokens) / T over the step's completions, subtracted before the advantages and kept out "
               "of reward/mean and solve_rate (logged only with compute_cost > 0)", "reward"),
    MetricSpec(REWARD_ERRORS_FN, "completions one reward function failed on: raised, timed out, crashed or "
               "returned a non-number (scored 0)", "count"),
    MetricSpec(GUARD_SKIPPED_STEPS, "steps skipped by the non-finite guard so far (loss or gradient NaN/inf: "
               "no weight change)", "count", "all"),
    MetricSpec(SOLVE_RATE,
               "fraction of the step's completions judged correct by the first reward function "
               "(LM stages: of the held-out samples, logged with eval/solve_rate)", "fraction",
               "all"),
    MetricSpec(GROUPS_UNIFORM_FRAC,
               "fraction of groups whose G rewards are all equal (zero advantage)", "fraction"),
    # policy update
    MetricSpec(KL_REF, "KL(policy || reference) per token, estimator of the recipe", "nats/token"),
    MetricSpec(LOSS_POLICY, "policy-gradient (PPO-clip / REINFORCE) loss", "loss"),
    MetricSpec(LOSS_KL, "KL penalty term of the loss (coefficient applied)", "loss"),
    MetricSpec(LOSS_TOTAL, "total loss that was back-propagated", "loss", "all"),
    MetricSpec(POLICY_CLIP_FRAC, "fraction of tokens whose importance ratio was clipped",
               "fraction"),
    MetricSpec(POLICY_RATIO_MEAN, "mean importance ratio pi_theta / pi_old over tokens", "ratio"),
    MetricSpec(POLICY_RATIO_MAX, "max importance ratio over tokens", "ratio"),
    MetricSpec(POLICY_RATIO_MIN, "min importance ratio over tokens", "ratio"),
    # gradients
    MetricSpec(GRAD_NORM_TOTAL, "global L2 gradient norm before clipping", "L2", "all"),
    MetricSpec(GRAD_NORM_GROUP,
               "L2 gradient norm of a module group (embed, block, injection, gate, norm, "
               "lm_head, other)", "L2", "all"),
    MetricSpec(GRAD_NORM_LAYER, "L2 gradient norm of shared-block layer i (0-based)", "L2",
               "all"),
    # what leaves the learner
    MetricSpec(SYNC_CHANGED_FRAC,
               "fraction of the trained elements (a LoRA run: of the adapters; learned loop weights included) whose "
               "value in the engines' dtype this step's update changed; a 16-bit learner's weights are its fp32 "
               "masters rounded to nearest, so an element whose accumulated change is below half an ulp stays "
               "put (0 on a step the guard skipped)", "fraction"),
    # LoRA adapters (learner.lora), per target group (q_proj, ..., down_proj)
    MetricSpec(LORA_A_NORM, "Frobenius norm of a target group's LoRA A matrices (all layers and loop steps)",
               "L2"),
    MetricSpec(LORA_B_NORM, "Frobenius norm of a target group's LoRA B matrices (0 at the start)", "L2"),
    MetricSpec(LORA_UPDATE_NORM, "norm of the weight update alpha/r * B A a target group's adapters make "
               "(0 at the start: how far the policy moved from the base)", "L2"),
    # the loops
    MetricSpec(ENTROPY_LOOP, "mean token entropy of P^(t), loop t (1-based)", "nats/token"),
    MetricSpec(EXIT_P, "mean exit probability p_t of loop t over tokens (sums to 1 over t)",
               "probability", "all"),
    MetricSpec(EXIT_MEAN_STEP, "mean expected exit step sum_t t*p_t over tokens", "loops", "all"),
    MetricSpec(EXIT_COLLAPSE,
               "gate-collapse indicator: fraction of tokens whose exit mass on loop 1 is "
               ">= 0.9 (0 = none collapsed, 1 = every token exits after loop 1)", "fraction",
               "all"),
    MetricSpec(EXIT_ENTROPY, "mean entropy H(p) of the exit distribution over tokens",
               "nats/token", "all"),
    # sampler vs learner
    MetricSpec(MISMATCH_MAX_ABS, "max |logp_learner - logp_sampler| over completion tokens",
               "nats"),
    MetricSpec(MISMATCH_MEAN_ABS, "mean |logp_learner - logp_sampler| over completion tokens",
               "nats"),
    MetricSpec(MISMATCH_K3,
               "k3 estimate of KL(sampler || learner): mean of r - 1 - log r, "
               "r = p_learner / p_sampler", "nats/token"),
    MetricSpec(CORRECTION_MASKED_FRAC,
               "fraction of completion tokens the rollout correction masked (ratio p_learner / p_sampler "
               "outside [correction_lo, correction_hi]); they contribute nothing to the update", "fraction"),
    MetricSpec(CORRECTION_WEIGHT_MEAN,
               "mean rollout-correction weight over the tokens it kept (1 = no correction)", "ratio"),
    MetricSpec(CORRECTION_WEIGHT_MAX, "largest rollout-correction weight over the completion tokens", "ratio"),
    # completions
    MetricSpec(LENGTH_MEAN, "mean completion length", "tokens"),
    MetricSpec(LENGTH_MAX, "max completion length", "tokens"),
    MetricSpec(LENGTH_TRUNC_FRAC, "fraction of completions cut at max_new_tokens", "fraction"),
    MetricSpec(LENGTH_FORCED_FRAC, "fraction of completions given the forced answer (thinking budget)", "fraction"),
    MetricSpec(LENGTH_THINK_MEAN, "mean thinking length (through the close marker; all if unclosed)", "tokens"),
    MetricSpec(LENGTH_ANSWER_MEAN, "mean answer length (after the close marker)", "tokens"),
    MetricSpec(LENGTH_UNCLOSED_FRAC, "fraction of completions that never close their thinking", "fraction"),
    # systems
    MetricSpec(TIME_ROLLOUT, "wall time of generation (and reward scoring)", "s"),
    MetricSpec(TIME_LEARNER, "wall time of the learner update(s)", "s"),
    MetricSpec(TIME_WEIGHT_SYNC, "wall time of learner -> rollout weight sync", "s"),
    MetricSpec(TIME_STEP, "wall time of the whole step", "s", "all"),
    MetricSpec(THROUGHPUT_TOKENS_PER_S, "tokens processed per second of step time", "tokens/s",
               "all"),
    MetricSpec(THROUGHPUT_GOODPUT,
               "goodput: completions of the step's first rollout whose task reward is positive, per second of "
               "that rollout (generation and reward scoring; the slowest rank's time)", "completions/s"),
    MetricSpec(MEMORY_PEAK_GB, "peak memory: CUDA max allocated since the previous record (the step's), "
               "else process max RSS since start", "GiB",
               "all"),
    MetricSpec(LR, "learning rate used at this step", "lr", "all"),
    # LM stage (pretrain / convert)
    MetricSpec(LM_LOSS, "expected LM loss sum_t p_t L_t (without the -beta*H(p) term)",
               "nats/token", "lm"),
    MetricSpec(LM_LOSS_STEP, "LM cross-entropy L_t of loop t (1-based)", "nats/token", "lm"),
    # compute (RL)
    MetricSpec(COMPUTE_MEAN_EXIT,
               "mean recorded exit step t* of the step's sampled completion tokens (the exit policy's "
               "choice, not the gate's expectation exit/mean_step)", "loops"),
    MetricSpec(COMPUTE_PASSES_PER_TOKEN,
               "serial block passes per generated token of the rollout (T for the dense schedule; about the "
               "mean exit step for the deferred one); absent when the engine does not count them (vLLM)",
               "passes/token"),
    MetricSpec(COMPUTE_EXIT_ENTROPY,
               "entropy of the histogram of recorded exit steps t* over the step's sampled completion tokens "
               "(0: every token exits at one step; log T: evenly spread)", "nats"),
    # rollout engine (RL)
    MetricSpec(ROLLOUT_SEQUENCES, "completions sampled in the step's first rollout, all ranks",
               "count"),
    MetricSpec(ROLLOUT_REFILLS,
               "extra rollout rounds dynamic sampling drew to replace uniform groups", "count"),
    MetricSpec(ROLLOUT_OCCUPANCY,
               "rows with work in a pass of the shared block over the engine's row bound (rollout.chunk_rows, or "
               "the call's rows), averaged over every pass of the step's rollout, all ranks; absent without passes "
               "(vLLM)", "fraction"),
    MetricSpec(ROLLOUT_OCCUPANCY_WAITING,
               "rollout/occupancy over the passes during which rows of the call were still waiting to start (later "
               "chunks, or rows not yet admitted with rollout.continuous_batching); absent when no row waited",
               "fraction"),
    # multi-turn episodes (RL with env.name set)
    MetricSpec(ENV_TURNS_MEAN, "model turns per episode of the step's first rollout, mean over episodes", "turns"),
    MetricSpec(ENV_TOOL_CALLS_MEAN, "tool calls per episode, mean over the step's episodes", "calls"),
    MetricSpec(ENV_TOOL_USE_FRAC, "fraction of the step's episodes that called a tool at least once", "fraction"),
    MetricSpec(ENV_TOOL_ERRORS, "tool calls of the step's episodes that failed (timeout, limit, exception, "
               "unknown tool; answered with the error, the episode goes on)", "count"),
    MetricSpec(ENV_TRUNCATED_FRAC, "fraction of episodes cut by env.max_turns, env.max_tokens or a turn's "
               "rollout.max_new_tokens", "fraction"),
    MetricSpec(ENV_REWARD_MEAN, "mean episode reward (the recipe's rewards on each episode's final answer)",
               "reward"),
    MetricSpec(ENV_ERRORS, "episodes an environment crash ended (scored 0, the run goes on)", "count"),
    # Ray orchestration
    MetricSpec(ORCH_STALENESS, "weights versions between the rollouts' sampler and the update that "
               "trains on them, the most over the step's tokens (0 on-policy; min(step - 1, K) with "
               "orchestration.max_staleness=K; at most K with partial_rollouts, whose rows mix versions)",
               "versions"),
    MetricSpec(ORCH_STALENESS_MEAN, "the same staleness, averaged over the step's tokens (equal to "
               "orchestration/staleness in the deterministic pipeline: a step's rows share one version)",
               "versions"),
    MetricSpec(ORCH_OVERLAP_SAVED_S, "rollout time hidden behind this step's update: the rows sampled "
               "ahead during it (orchestration.max_staleness >= 1)", "s"),
    MetricSpec(ORCH_WORKER_RESTARTS, "rollout-worker restarts so far (a dead worker, restarted by Ray)",
               "count"),
    MetricSpec(ORCH_REISSUED_SHARDS, "rollout shards issued again this step after their worker died "
               "(the rows come back as they would have)", "count"),
    MetricSpec(ORCH_DROPPED_ROWS, "rows dropped, never trained on, since the previous step's batch was formed "
               "(orchestration.partial_rollouts): every row of each group with a token more than "
               "orchestration.max_staleness versions behind the learner", "rows"),
    MetricSpec(ORCH_PARTIAL_ROWS, "rows of the step's batch whose tokens were sampled at more than one weights "
               "version (orchestration.partial_rollouts: a row continued under newer weights)", "rows"),
    MetricSpec(ORCH_LEARNER_IDLE_FRAC, "share of the step's wall time (time/step) in which the learner group ran "
               "no update: 1 - (the slowest learner's update seconds) / time/step", "fraction"),
    MetricSpec(ORCH_ROLLOUT_IDLE_FRAC, "share of the step's wall time (time/step) in which no generate call was in "
               "flight on the rollout workers: 1 - (seconds with one in flight, driver clock) / time/step",
               "fraction"),
    # held-out evaluation
    MetricSpec(EVAL_SOLVE_RATE,
               "held-out solve rate: fraction of sampled completions judged correct", "fraction",
               "all"),
    MetricSpec(EVAL_REWARD_MEAN, "mean total reward of the held-out completions", "reward"),
    MetricSpec(EVAL_COMPUTE_MEAN_EXIT,
               "mean recorded exit step t* over the held-out completion tokens (at train.eval_exit_policy)",
               "loops"),
    MetricSpec(EVAL_COMPUTE_PASSES_PER_TOKEN,
               "serial block passes per generated held-out token (absent when the engine does not count them)",
               "passes/token"),
    MetricSpec(EVAL_LM_LOSS, "held-out expected LM loss sum_t p_t L_t", "nats/token", "lm"),
    MetricSpec(EVAL_LM_LOSS_STEP, "held-out LM cross-entropy L_t of loop t (1-based)",
               "nats/token", "lm"),
    MetricSpec(EVAL_COMPLETION_LENGTH, "mean length of the held-out completions", "tokens", "lm"),
    MetricSpec(EVAL_EXIT_P, "held-out mean exit probability p_t of loop t (1-based)",
               "probability", "lm"),
    MetricSpec(EVAL_EXIT_MEAN_STEP, "held-out mean expected exit step sum_t t*p_t", "loops",
               "lm"),
    MetricSpec(EVAL_EXIT_COLLAPSE,
               "held-out fraction of tokens whose exit mass on loop 1 is >= 0.9", "fraction",
               "lm"),
    MetricSpec(EVAL_EXIT_ENTROPY, "held-out mean entropy H(p) of the exit distribution",
               "nats/token", "lm"),
)

_RESERVED_REWARD_NAMES = {"mean", "std", "errors", "compute"}


def _template_regex(template: str) -> re.Pattern[str]:
    head, rest = template.split("{", 1)
    placeholder, tail = rest.split("}", 1)
    value = r"\d+" if placeholder in ("t", "i") else r"[^/]+"
    return re.compile(f"^{re.escape(head)}(?P<value>{value}){re.escape(tail)}$")


_BY_KEY = {spec.key: spec for spec in METRICS if not spec.is_template}
_TEMPLATES = [(spec, _template_regex(spec.key)) for spec in METRICS if spec.is_template]


def lookup(key: str) -> MetricSpec | None:
    """The :class:`MetricSpec` that documents ``key`` (literal or via a template), or None."""
    spec = _BY_KEY.get(key)
    if spec is not None:
        return spec
    for spec, pattern in _TEMPLATES:
        if pattern.match(key):
            return spec
    return None


def indexed(keys: Iterable[str], template: str) -> dict[int, str]:
    """Keys that instantiate an integer template, by index: ``{1: "exit/p_1", 2: ...}``.

    ``template`` is one of :data:`EXIT_P`, :data:`ENTROPY_LOOP`, :data:`GRAD_NORM_LAYER`,
    :data:`LM_LOSS_STEP`, :data:`EVAL_EXIT_P`, :data:`EVAL_LM_LOSS_STEP`. The result is sorted
    by index.
    """
    pattern = _template_regex(template)
    found = {}
    for key in keys:
        m = pattern.match(key)
        if m:
            found[int(m.group("value"))] = key
    return dict(sorted(found.items()))


def named(keys: Iterable[str], template: str) -> dict[str, str]:
    """Keys that instantiate a name template (:data:`REWARD_FN`, :data:`GRAD_NORM_GROUP`).

    For ``reward/{fn}`` the fixed reward keys (mean, std, errors) are excluded.
    """
    pattern = _template_regex(template)
    found = {}
    for key in keys:
        if key in _BY_KEY:
            continue
        m = pattern.match(key)
        if m:
            found[m.group("value")] = key
    return dict(sorted(found.items()))


def markdown_table(stage: str | None = None) -> str:
    """The vocabulary as a Markdown table (``stage`` filters: "rl", "lm"; None = all)."""
    rows = ["| key | meaning | unit |", "|---|---|---|"]
    for spec in METRICS:
        if stage is None or spec.stage in (stage, "all"):
            rows.append(f"| `{spec.key}` | {spec.meaning} | {spec.unit} |")
    return "\n".join(rows)


def unknown_keys(metrics: Mapping[str, object]) -> list[str]:
    """Keys of ``metrics`` that the vocabulary does not document."""
    return [key for key in metrics if lookup(key) is None]
