"""Evaluating a policy, the one place it is written.

The held-out evaluation `rltt train` logs (`HeldOutEvaluator`: ``eval/solve_rate`` ...) and
`rltt eval` (`evaluate_recipe`) sample with `eval_sampling` — the recipe's rollout settings
(`rltt.orchestration.policy.sampling_params`) at ``train.eval_temperature`` and the evaluation
exit policy (`eval_exit_policy`), seeded ``recipe.seed + EVAL_SEED_OFFSET`` — and score with
`evaluate`. So `rltt eval` of a run's checkpoint reproduces the ``eval/solve_rate`` the run logged
at that step. The statistics over the per-problem results (pass@k, intervals, paired tests) are
`rltt.evaluation`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

from rltt.data.prompts import recipe_prompt_renderer
from rltt.data.rewards import RewardRunner
from rltt.errors import RlttError
from rltt.evaluation.results import ProblemCounts
from rltt.orchestration.episodes import EpisodeRunner
from rltt.orchestration.groups import sample_scored
from rltt.orchestration.policy import RecipePolicy, sampling_params, stop_ids
from rltt.orchestration.prompt_stream import Task, eval_tasks
from rltt.rollout import RolloutEngine, SamplingParams
from rltt.sections import parsed_exit_policy
from rltt.telemetry import schema as m

EVAL_SEED_OFFSET = 7  # the evaluation's draws: seed recipe.seed + 7, apart from every rollout seed


@dataclass
class EvalResult:
    """Sums over the evaluated samples; the rates are properties, so results of disjoint task
    shards (data-parallel ranks) merge exactly: ``EvalResult(**combine([vars(p) for p in parts],
    EvalResult.OPS))`` (or `reduce_ranks` across ranks)."""

    #: how shards merge (`rltt.runtime.distributed.combine`)
    OPS: ClassVar[dict[str, str]] = {"solved": "sum", "samples": "sum", "reward_sum": "sum", "task_counts": "concat",
                                     "exit_step_sum": "sum", "tokens": "sum", "row_passes": "sum",
                                     "passes_tokens": "sum"}

    solved: int
    samples: int
    reward_sum: float
    task_counts: dict[str, tuple[int, int]]  # task id -> (samples, solved): counts, never rebuilt from rates
    exit_step_sum: float
    tokens: int  # sampled completion tokens (the exits counted)
    row_passes: float = 0.0  # serial block passes of the rows, where the engine counts them
    passes_tokens: int = 0  # the completion tokens of those calls

    @property
    def per_task(self) -> dict[str, float]:
        """Task id -> the fraction of its samples solved."""
        return {task: solved / n for task, (n, solved) in self.task_counts.items()}

    def counts(self, origin: str = "") -> ProblemCounts:
        """The per-problem counts (samples, solved) the statistics of `rltt.evaluation` take."""
        ids = list(self.task_counts)
        return ProblemCounts(ids, [self.task_counts[t][0] for t in ids], [self.task_counts[t][1] for t in ids], origin)

    @property
    def solve_rate(self) -> float:
        return self.solved / self.samples if self.samples else 0.0

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / self.samples if self.samples else 0.0

    @property
    def mean_exit_step(self) -> float:
        return self.exit_step_sum / max(self.tokens, 1)

    @property
    def passes_per_token(self) -> float | None:
        """Serial block passes per generated token; None when the engine did not count them (vLLM)."""
        return self.row_passes / self.passes_tokens if self.passes_tokens else None


def eval_exit_policy(recipe):
    """The exit policy a train recipe evaluates with: ``train.eval_exit_policy`` (e.g. a
    deployment ``threshold:q``), else the rollout's ``rollout.exit_policy`` (parsed, `ExitPolicy`)."""
    if getattr(recipe.train, "eval_exit_policy", None) is not None:
        return parsed_exit_policy(recipe.train, "eval_exit_policy", "train.eval_exit_policy")
    return parsed_exit_policy(recipe.rollout, "exit_policy", "rollout.exit_policy")


def eval_sampling(recipe, stop_token_ids: list[int], decode, thinking=None, *, samples: int | None = None,
                  temperature: float | None = None, exit_policy=None) -> SamplingParams:
    """The sampling settings of the recipe's evaluation: its rollout's, with ``train.eval_samples``
    completions per prompt at ``train.eval_temperature`` and `eval_exit_policy`, seeded
    ``recipe.seed + EVAL_SEED_OFFSET`` (`evaluate` offsets the seed per task chunk). ``samples``,
    ``temperature`` and ``exit_policy`` replace the recipe's values (`rltt eval`'s flags)."""
    train = recipe.train
    return sampling_params(recipe.rollout, stop_token_ids, decode, thinking,
                           n=train.eval_samples if samples is None else samples,
                           temperature=train.eval_temperature if temperature is None else temperature,
                           exit_policy=eval_exit_policy(recipe) if exit_policy is None else exit_policy,
                           seed=recipe.seed + EVAL_SEED_OFFSET)


def evaluate(engine: RolloutEngine, tasks: list[Task], decode, runner: RewardRunner, params: SamplingParams,
             chunk: int = 64, shard: tuple[int, int] = (0, 1), episodes: EpisodeRunner | None = None) -> EvalResult:
    """Sample ``params.n`` completions per task with ``params`` and score them; the primary reward
    decides 'solved'.

    Tasks go to the engine in chunks of ``chunk``, the one at task ``start`` seeded ``params.seed +
    start``; ``shard = (i, n)`` evaluates the chunks ``i, i + n, ...`` only, so the merged results of
    the n shards equal one unsharded evaluation. ``episodes``: each sample is a multi-turn episode
    (the recipe's ``env``), scored on its final answer."""
    primary = runner.names[0]
    samples = params.n
    rank, world = shard
    result = EvalResult(0, 0, 0.0, {}, 0.0, 0)
    for index, start in enumerate(range(0, len(tasks), chunk)):
        if index % world != rank:
            continue
        part = tasks[start:start + chunk]
        scored = sample_scored(engine, part, replace(params, seed=params.seed + start), decode, runner, episodes)
        rollout = scored.rollout
        flags = scored.solved(primary).view(len(part), samples)
        result.solved += int(flags.sum())
        result.samples += flags.numel()
        result.reward_sum += sum(scored.rewards.tolist())
        for task, row in zip(part, flags.sum(1).tolist()):
            result.task_counts[task.id] = (samples, int(row))
        mask = rollout.action_mask  # sampled tokens (forced ones have no exit)
        result.exit_step_sum += float(rollout.exit_steps[mask].float().sum())
        result.tokens += int(mask.sum())
        if rollout.stats.row_passes is not None:
            result.row_passes += float(rollout.stats.row_passes.sum())
            result.passes_tokens += rollout.stats.tokens
    return result


class HeldOutEvaluator:
    """The run's held-out evaluation: the solve rate of the rollout policy on ``tasks``, with the
    recipe's evaluation settings (`eval_sampling`), beside the mean recorded exit step and the
    serial passes per token it took. With several ranks each evaluates its share of the task
    chunks (every rank holds the same weights) and the sums are reduced: the same numbers as one
    process, in 1/world of the time. A collective: every rank calls it."""

    def __init__(self, recipe, engine: RolloutEngine, tasks: list[Task], tokenizer, runner: RewardRunner, ranks,
                 thinking=None, episodes: EpisodeRunner | None = None):
        self.engine, self.tasks, self.decode, self.runner, self.ranks = (
            engine, tasks, tokenizer.decode, runner, ranks)
        self.params = eval_sampling(recipe, stop_ids(tokenizer), tokenizer.decode, thinking)
        # the training step's episodes and environment workers when given (one pool per run), else its own
        self.episodes = episodes if episodes is not None else EpisodeRunner.from_recipe(
            recipe, lambda text: tokenizer(text, add_special_tokens=False).input_ids, tokenizer.decode)

    def __call__(self) -> dict[str, float]:
        part = evaluate(self.engine, self.tasks, self.decode, self.runner, self.params,
                        shard=(self.ranks.rank, self.ranks.world), episodes=self.episodes)
        result = EvalResult(**self.ranks.reduce(vars(part), EvalResult.OPS))
        out = {m.EVAL_SOLVE_RATE: result.solve_rate, m.EVAL_REWARD_MEAN: result.reward_mean,
               m.EVAL_COMPUTE_MEAN_EXIT: result.mean_exit_step}
        if result.passes_per_token is not None:
            out[m.EVAL_COMPUTE_PASSES_PER_TOKEN] = result.passes_per_token
        return out


@dataclass
class EvalReport:
    """A held-out evaluation: where, how, and the `EvalResult`."""

    model: str
    source: str
    split: str
    tasks: int
    samples: int
    temperature: float
    result: EvalResult
    exit_policy: str | None = None  # the policy it scored with (None: the model config's)

    def to_dict(self) -> dict:
        r = self.result
        return {"model": self.model, "source": self.source, "split": self.split, "tasks": self.tasks,
                "samples": self.samples, "temperature": self.temperature, "solve_rate": r.solve_rate,
                "reward_mean": r.reward_mean, "mean_exit_step": r.mean_exit_step, "per_task": r.per_task}

    def summary(self) -> str:
        r = self.result
        return (f"{self.model} on {self.source} [{self.split}]: {self.tasks} prompts x {self.samples} samples "
                f"(temperature {self.temperature:g})\n"
                f"solve rate {r.solve_rate:.4f}, mean reward {r.reward_mean:.4f}, mean exit step "
                f"{r.mean_exit_step:.2f}")


def evaluate_recipe(recipe, *, samples: int | None = None, split: str | None = None, limit: int | None = None,
                    source: str | None = None, temperature: float | None = None, exit_policy=None,
                    recipe_root: Path | None = None, model: str | None = None) -> EvalReport:
    """Held-out solve rate and mean reward of the recipe's policy (or ``model``) on its eval source.

    Defaults are the recipe's own evaluation (`eval_sampling`; ``data.eval_source``/``eval_split``/
    ``eval_size``), so it reproduces the numbers `rltt train` logs as ``eval/solve_rate``.
    """
    d = recipe.data
    size = limit if limit is not None else d.eval_size
    split = split or d.eval_split
    if samples is not None and samples < 1:
        raise RlttError(f"--samples: must be >= 1, got {samples}")
    if size < 1:
        raise RlttError(f"--limit: must be >= 1, got {size}")
    if temperature is not None and temperature < 0:
        raise RlttError(f"--temperature: must be >= 0, got {temperature}")
    eval_source = source or d.eval_source
    with RecipePolicy.load(recipe, recipe_root, model) as policy:
        tasks = eval_tasks(eval_source, d.source, policy.encode, recipe_prompt_renderer(d, policy.tokenizer), split,
                           size, d.seed)
        params = eval_sampling(recipe, stop_ids(policy.tokenizer), policy.decode, policy.thinking(recipe),
                               samples=samples, temperature=temperature, exit_policy=exit_policy)
        episodes = EpisodeRunner.from_recipe(recipe, policy.encode, policy.decode)
        try:
            result = evaluate(policy.engine, tasks, policy.decode, policy.runner, params, episodes=episodes)
        finally:
            if episodes is not None:
                episodes.close()  # the environment's worker processes
    shown_source = eval_source or (f"{d.source} (held out)" if d.source.startswith("synthetic") else d.source)
    return EvalReport(str(policy.model_path), shown_source, split, len(tasks), params.n, params.temperature, result,
                      None if params.exit_policy is None else str(params.exit_policy))
