"""The RL training step, the one place it is written:

    prompts → engine.generate → rewards → advantages (once) → dynamic filter → LearnerBatch
            → learner.update → engine.load_weights(*learner.rollout_state_dict()) → metrics

With an ``env:`` section (``env.name`` set) ``engine.generate`` is a multi-turn episode per row
(`rltt.orchestration.episodes`): turns and environment answers in one `RolloutBatch` row, the
environment's tokens masked, the rewards on the final answer; the rest of the step is the same.

An update the learner's non-finite guard skipped leaves its ``version`` (and weights) as they
were: the engines keep serving the weights they have (no sync), and the step's metrics carry
the reason under ``rltt.learner.SKIP_REASON`` for the loop's `NonFiniteGuard`.

`TrainingStep` talks to a `RolloutEngine` and a `Learner` only through their interfaces, so the
local loop, every torchrun rank and a Ray driver run the same step with their own engine and
learner (a Ray driver passes ``Ranks()``: its learner group splits the batch itself).

Rollout seeds are keyed by (recipe seed, step, attempt, GLOBAL prompt index) and go to the
engine as ``SamplingParams.prompt_seeds``: a prompt's completions do not depend on how many
ranks or workers share the step, nor on which prompts share a call.
"""

from __future__ import annotations

import time

import torch

from rltt.data.rewards import RewardRunner, reward_error_metrics
from rltt.learner import LearnerAPI, LearnerBatch
from rltt.runtime.distributed import Ranks
from rltt.runtime.stop import commit
from rltt.orchestration.episodes import EpisodeRunner
from rltt.orchestration.groups import ScoredGroups, ScoredRollout, sample_scored, score_groups
from rltt.orchestration.policy import sampling_params
from rltt.orchestration.prompt_stream import PromptStream, Task
from rltt.orchestration.train_recipe import TrainRecipe
from rltt.data.reasoning import length_metrics, length_sums
from rltt.rollout import RolloutEngine, SamplingParams
from rltt.rollout.params import ThinkingBudget
from rltt.rollout.seeds import rollout_seed
from rltt.telemetry import Timer, peak_memory_gb, reset_peak_memory
from rltt.telemetry import schema as m

def rollout_metrics(scored: ScoredRollout, groups: ScoredGroups, ranks: Ranks, primary: str,
                    thinking: ThinkingBudget | None = None, seconds: float | None = None) -> dict[str, float]:
    """Metrics of one rollout over every rank's rows (a collective), as one process would log them;
    with a thinking budget also the ``length/*`` thinking metrics; with ``seconds`` (this rank's
    wall time of the rollout and its reward scoring) the goodput."""
    rollout = scored.rollout
    stats = rollout.stats
    counted = stats.row_passes is not None
    exits = rollout.exit_steps[rollout.action_mask]  # recorded t* of the sampled tokens
    local = {
        "rewards": scored.rewards.float(), "lengths": rollout.completion_lengths.float(),
        "truncated": sum(reason == "length" for reason in rollout.finish_reasons),
        "exit_steps": int(exits.sum()), "actions": int(rollout.action_mask.sum()),
        "exit_hist": torch.bincount(exits.long().flatten() - 1, minlength=rollout.num_loops)[:rollout.num_loops],
        "positive": int((scored.rewards > 0).sum()), "seconds": float(seconds or 0.0),
        "compute": (groups.compute if groups.compute is not None else torch.zeros(0, dtype=torch.float64)),
        "errors": len(scored.errors),
        "row_passes": float(stats.row_passes.sum()) if counted else 0.0, "tokens": stats.tokens if counted else 0,
        "uniform": int(groups.uniform.sum()), "groups": groups.num_groups,
        # occupancy: every rank's passes, each pass's live rows over its engine's row bound
        "occupied": float(stats.occupied), "occupied_passes": int(stats.occupied_passes),
        "waiting_occupied": float(stats.waiting_occupied), "waiting_passes": int(stats.waiting_passes),
        **{f"fn/{name}": values for name, values in scored.per_fn.items()},
        **{f"err/{key}": n for key, n in reward_error_metrics(scored.errors, scored.per_fn).items()},
    }
    if thinking is not None:
        local.update({f"think/{k}": v for k, v in length_sums(rollout, thinking.close).items()})
    env = getattr(scored, "env", None)  # multi-turn episodes: per-row counts, summed over every rank's rows
    if env is not None:
        local.update({f"episodes:{k}": int(v.sum()) for k, v in env.items()})
        local["episodes:tool_use"] = int((env["tool_calls"] > 0).sum())  # episodes that called a tool at all
    sums = ("truncated", "exit_steps", "actions", "errors", "row_passes", "tokens", "uniform", "groups",
            "occupied", "occupied_passes", "waiting_occupied", "waiting_passes",
            "exit_hist", "positive", *(k for k in local if k.startswith(("think/", "err/", "episodes:"))))
    t = ranks.reduce(local, {k: "max" if k == "seconds" else "sum" if k in sums else "concat" for k in local})
    rewards, lengths = t["rewards"], t["lengths"]
    out = {
        m.REWARD_MEAN: float(rewards.mean()),
        m.REWARD_STD: float(rewards.std()) if rewards.numel() > 1 else 0.0,
        m.REWARD_ERRORS: t["errors"],
        m.SOLVE_RATE: int((t[f"fn/{primary}"] >= 1.0).sum()) / rewards.numel(),
        m.GROUPS_UNIFORM_FRAC: t["uniform"] / t["groups"] if t["groups"] else 0.0,
        m.LENGTH_MEAN: float(lengths.mean()),
        m.LENGTH_MAX: float(lengths.max()),
        m.LENGTH_TRUNC_FRAC: t["truncated"] / lengths.numel(),
        m.COMPUTE_MEAN_EXIT: t["exit_steps"] / max(float(t["actions"]), 1),
        m.ROLLOUT_SEQUENCES: rewards.numel(),
    }
    if t["actions"]:
        out[m.COMPUTE_EXIT_ENTROPY] = exit_histogram_entropy(t["exit_hist"])
    if counted and t["tokens"]:  # an engine that does not count its passes (vLLM) leaves the key out
        out[m.COMPUTE_PASSES_PER_TOKEN] = t["row_passes"] / t["tokens"]
    if t["occupied_passes"]:  # an engine without passes (vLLM) leaves both keys out
        out[m.ROLLOUT_OCCUPANCY] = t["occupied"] / t["occupied_passes"]
        if t["waiting_passes"]:
            out[m.ROLLOUT_OCCUPANCY_WAITING] = t["waiting_occupied"] / t["waiting_passes"]
    if groups.compute is not None and t["compute"].numel():  # a price on compute: its mean, apart from the task's
        out[m.REWARD_COMPUTE] = float(t["compute"].mean())
    if seconds is not None and t["seconds"] > 0:  # ranks sample concurrently: the slowest one's time
        out[m.THROUGHPUT_GOODPUT] = t["positive"] / t["seconds"]
    if thinking is not None:
        out.update(length_metrics({k[len("think/"):]: v for k, v in t.items() if k.startswith("think/")}))
    if env is not None:
        episodes = rewards.numel()
        out.update({m.ENV_TURNS_MEAN: t["episodes:turns"] / episodes,
                    m.ENV_TOOL_CALLS_MEAN: t["episodes:tool_calls"] / episodes,
                    m.ENV_TOOL_USE_FRAC: t["episodes:tool_use"] / episodes,
                    m.ENV_TOOL_ERRORS: t["episodes:tool_errors"], m.ENV_TRUNCATED_FRAC: t["episodes:truncated"] / episodes,
                    m.ENV_REWARD_MEAN: float(rewards.mean()), m.ENV_ERRORS: t["episodes:errors"]})
    for name in scored.per_fn:
        values = t[f"fn/{name}"].tolist()
        out[m.reward_key(name)] = sum(values) / len(values)
    out.update({k[len("err/"):]: v for k, v in t.items() if k.startswith("err/")})  # reward/errors/<fn>
    return out


def exit_histogram_entropy(counts: torch.Tensor) -> float:
    """Entropy (nats) of the histogram of recorded exit steps (``counts[t - 1]``: tokens that
    exited at loop t): 0 when every token exits at one step, log T when they spread evenly."""
    p = counts.double() / counts.sum().clamp_min(1)
    p = p[p > 0]
    return float(-(p * p.log()).sum()) if p.numel() else 0.0


class TrainingStep:
    """One RL step with a given engine and learner; ``step(n)`` returns the step's metrics.

    Every rank of a data-parallel run calls it with its own engine and learner (the collectives
    inside are reached by all ranks in the same order); ``prompts`` is the global stream, which
    every rank draws from identically."""

    def __init__(self, recipe: TrainRecipe, engine: RolloutEngine, learner: LearnerAPI, prompts: PromptStream,
                 runner: RewardRunner, decode, stop_token_ids: list[int], pad_id: int = 0, ranks: Ranks = Ranks(),
                 thinking: ThinkingBudget | None = None, encode=None):
        self.recipe, self.engine, self.learner, self.prompts = recipe, engine, learner, prompts
        # with env.name set every row is a multi-turn episode (``encode``: the tokenizer's, for its answers)
        self.episodes = EpisodeRunner.from_recipe(recipe, encode, decode)
        self.thinking = thinking  # rollout.thinking as token ids (rltt.data.reasoning.thinking_budget)
        self.runner, self.decode, self.stop_token_ids, self.pad_id, self.ranks = (
            runner, decode, list(stop_token_ids), pad_id, ranks)

    def sampling(self, step: int, attempt: int, indices) -> SamplingParams:
        """Sampling settings of the prompts with these global indices in ``attempt``."""
        seeds = [rollout_seed(self.recipe.seed, step, attempt, i) for i in indices]
        return sampling_params(self.recipe.rollout, self.stop_token_ids, self.decode, self.thinking,
                               seed=rollout_seed(self.recipe.seed, step, attempt, -1), prompt_seeds=seeds,
                               n=self.recipe.rollout.group_size)

    def _sample(self, tasks: list[Task], params: SamplingParams) -> tuple[ScoredRollout, ScoredGroups]:
        """Generate and score ``tasks``; the groups carry their advantages (computed once)."""
        scored = sample_scored(self.engine, tasks, params, self.decode, self.runner, self.episodes)
        return scored, self.score(scored, params.prompt_seeds)

    def score(self, scored: ScoredRollout, prompt_seeds: list[int]) -> ScoredGroups:
        """The groups of a scored rollout with their advantages, under the recipe's algorithm — the
        one place every step (synchronous, K-deep, partial) scores: with ``algorithm.kl_in: reward``
        the KL penalty, measured by the learner at the version its next update starts from (a
        partial rollout's rows may be up to K versions older), then the estimator, its scale and the
        price on compute (`score_groups`); ``prompt_seeds``: the groups' seeds, kept with them."""
        algo = self.recipe.algorithm
        batch = penalty = None
        if algo.kl_in == "reward" and algo.kl_coef > 0:
            batch = LearnerBatch.from_rollout(scored.rollout)
            penalty = algo.kl_coef * self.learner.sequence_kl(batch).cpu()
        return score_groups(scored, algo.advantage_scale, penalty, batch, prompt_seeds, estimator=algo.advantage,
                            compute_cost=algo.compute_cost, compute_price=algo.compute_price)

    def _empty(self) -> ScoredGroups:
        return ScoredGroups(LearnerBatch(*(torch.zeros((0, 1), dtype=d) for d in (torch.long, torch.long, torch.bool,
                                                                                   torch.long)),
                                         advantages=torch.zeros(0)),
                            torch.zeros(0), torch.zeros(0, dtype=torch.bool), self.recipe.rollout.group_size)

    def rollout(self, step: int) -> tuple[ScoredGroups, dict[str, float]]:
        """This rank's share of prompts_per_step groups and the metrics of the step's first rollout.
        With dynamic sampling, uniform groups are dropped and refilled from the stream: every rank
        draws every rank's refill prompts, so the streams stay equal."""
        r, ranks = self.recipe, self.ranks
        total = r.rollout.prompts_per_step
        want = total // ranks.world
        span = ranks.span(total)
        drawn = self.prompts.next(total)  # the global list, the same on every rank
        tasks = [drawn[i] for i in span]
        t0 = time.perf_counter()
        scored, groups = self._sample(tasks, self.sampling(step, 0, span))
        metrics = rollout_metrics(scored, groups, ranks, self.runner.names[0], self.thinking,
                                  seconds=time.perf_counter() - t0)
        if not r.algorithm.dynamic_sampling:
            return groups, metrics
        kept: list[ScoredGroups] = []
        have = refills = 0
        for attempt in range(1, r.algorithm.max_refills + 2):
            informative = torch.nonzero(~groups.uniform).flatten().tolist()
            kept.append(groups.select_groups(informative))
            have += len(informative)
            short = ranks.reduce({"short": [max(want - have, 0)]}, "concat")["short"]  # every rank's shortfall
            if not sum(short) or attempt > r.algorithm.max_refills:
                break
            refills += 1
            span = ranks.segment_span(short)
            drawn = self.prompts.next(sum(short))
            groups = self._sample([drawn[i] for i in span], self.sampling(step, attempt, span))[1] if span \
                else self._empty()
        if have < want:  # still short: top up with uniform groups (zero advantage)
            filler = torch.nonzero(groups.uniform).flatten().tolist()[: want - have]
            kept.append(groups.select_groups(filler))
        metrics["rollout/refills"] = refills
        return ScoredGroups.cat(kept, self.pad_id).select_groups(list(range(want))), metrics

    def __call__(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.runner.step = step  # recorded with reward errors
        timed: dict[str, float] = {}
        with Timer(timed, m.TIME_ROLLOUT):
            groups, metrics = self.rollout(step)
        tokens = int(groups.batch.target_mask.sum())
        work = self.ranks.reduce({"tokens": tokens, "time": timed[m.TIME_ROLLOUT]}, {"tokens": "sum", "time": "max"})
        version = self.learner.version
        commit()  # from the update on, a stop signal lets the step finish (rltt.runtime.stop)
        with Timer(timed, m.TIME_LEARNER):
            metrics.update(self.learner.update(groups.batch))
        if self.learner.version != version:  # a skipped update changed no weights: nothing to sync
            with Timer(timed, m.TIME_WEIGHT_SYNC):
                self.engine.load_weights(*self.learner.rollout_state_dict())
        metrics.update(timed)
        metrics[m.THROUGHPUT_TOKENS_PER_S] = work["tokens"] / max(work["time"], 1e-9)  # ranks sample concurrently
        metrics[m.TIME_STEP] = time.perf_counter() - t0
        metrics[m.MEMORY_PEAK_GB] = self.ranks.reduce({"gb": peak_memory_gb()}, "max")["gb"]
        reset_peak_memory()  # the next step's figure is its own peak
        return metrics

    def state_dict(self) -> dict:
        """What a checkpoint must keep of the step itself beyond the prompt stream (tensors and
        plain data): nothing for this step; a step that samples ahead keeps those rollouts."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` kept (``state`` is the whole loop state of the checkpoint)."""
