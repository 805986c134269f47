"""From rollouts to learner batches: reward scoring, groups with their advantages, selection.

The data path of one step: a `RolloutBatch` is scored (`score_rollout`), its advantages are
computed once (`score_groups`) and travel with the rows — through the dynamic-sampling filter,
the rollout metrics and into the learner — in a `ScoredGroups` whose `LearnerBatch` is built
straight from the rollout's tensors (`LearnerBatch.from_rollout`).

A price on compute (``algorithm.compute_cost`` = λ, `compute_penalty`) of λ · (mean recorded exit
step t* of a completion's sampled tokens) / T is subtracted from its task reward before the
advantages (``compute_price: reward``), or, centred in its group, from the advantages the task
reward alone gives (``advantage``; the table `rltt.objectives.advantages.COMPUTE_PRICES`); the task
rewards, the uniform-group flags and the reward metrics stay those of the task alone, and the
penalty travels with the rows (``ScoredGroups.compute``) for ``reward/compute``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from rltt.data.rewards import RewardError, RewardRunner, RewardSample
from rltt.learner.learner_batch import LearnerBatch
from rltt.objectives import group_advantages, uniform_groups
from rltt.objectives.advantages import COMPUTE_PRICES
from rltt.orchestration.prompt_stream import Task
from rltt.rollout import RolloutBatch


@dataclass
class ScoredRollout:
    """The rewards of every row of a `RolloutBatch` (rows prompt-major, ``group_size`` per prompt)."""

    rollout: RolloutBatch
    tasks: list[Task]  # one per prompt of the rollout
    rewards: torch.Tensor  # (R,) float64: the weighted totals, as the runner computed them
    per_fn: dict[str, torch.Tensor]  # reward function name -> (R,) float64
    errors: list[RewardError]
    env: dict[str, torch.Tensor] | None = None  # multi-turn episodes: per-row turns, tool_calls, ... (R,)

    @property
    def group_size(self) -> int:
        return self.rollout.params.n

    def solved(self, primary: str) -> torch.Tensor:
        """(R,) bool: the primary (first) reward function gives the row ≥ 1."""
        return self.per_fn[primary] >= 1.0


def score_rollout(rollout: RolloutBatch, tasks: list[Task], decode, runner: RewardRunner,
                  answers: list[str] | None = None, failed: torch.Tensor | None = None) -> ScoredRollout:
    """Decode every completion of ``rollout`` and score it against its task. Episodes
    (`rltt.orchestration.episodes`) give the text to score per row (``answers``, the final answer)
    and the rows an environment crash ended (``failed``, scored 0)."""
    samples = []
    sampled = rollout.action_mask.sum(dim=1).tolist()  # forced and environment tokens are not the policy's
    for r in range(rollout.num_rows):
        task = tasks[int(rollout.prompt_index[r])]
        text = decode(rollout.completion(r)) if answers is None else answers[r]
        samples.append(RewardSample(text, task.answer, task.id,
                                    {"completion_tokens": sampled[r], "max_tokens": rollout.params.max_new_tokens}))
    result = runner.score(samples)
    total = torch.tensor(result.total, dtype=torch.float64)
    per_fn = {k: torch.tensor(v, dtype=torch.float64) for k, v in result.scores.items()}
    if failed is not None and bool(failed.any()):
        for values in (total, *per_fn.values()):
            values[failed] = 0.0
    return ScoredRollout(rollout, list(tasks), total, per_fn, list(result.errors))


def sample_scored(engine, tasks: list[Task], params, decode, runner: RewardRunner, episodes=None) -> ScoredRollout:
    """Sample ``tasks`` and score them: one completion per row (one `RolloutEngine.generate` call),
    or with ``episodes`` (an `rltt.orchestration.episodes.EpisodeRunner`) one multi-turn episode
    per row, scored on its final answer, with its per-row counts in ``ScoredRollout.env``."""
    if episodes is None:
        return score_rollout(engine.generate([t.prompt_ids for t in tasks], params), tasks, decode, runner)
    batch = episodes.run(engine, tasks, params)
    scored = score_rollout(batch.rollout, tasks, decode, runner, batch.answers, batch.failed())
    scored.env = {"turns": batch.turns, "tool_calls": batch.tool_calls, "tool_errors": batch.tool_errors,
                  "truncated": batch.truncated, "errors": batch.failed()}
    return scored


@dataclass
class ScoredGroups:
    """Groups of G rows (prompt-major) ready for the learner: the batch with its advantages,
    the task rewards, and which groups are uniform (every task reward equal: no signal)."""

    batch: LearnerBatch  # advantages set
    rewards: torch.Tensor  # (R,) task rewards
    uniform: torch.Tensor  # (n_groups,) bool
    group_size: int
    task_ids: list[str] = field(default_factory=list)  # per group
    prompt_seeds: list[int] = field(default_factory=list)  # per group: the seed it was sampled with
    compute: torch.Tensor | None = None  # (R,) the compute penalty subtracted per row (compute_cost > 0)

    @property
    def num_groups(self) -> int:
        return int(self.uniform.shape[0])

    def select_groups(self, groups: list[int]) -> "ScoredGroups":
        G = self.group_size
        index = torch.tensor(groups, dtype=torch.long)
        rows = (index[:, None] * G + torch.arange(G)[None, :]).flatten()
        return ScoredGroups(self.batch.select(rows), self.rewards[rows], self.uniform[index], G,
                            [self.task_ids[g] for g in groups],
                            [self.prompt_seeds[g] for g in groups] if self.prompt_seeds else [],
                            None if self.compute is None else self.compute[rows])

    @classmethod
    def cat(cls, parts: list["ScoredGroups"], pad_id: int = 0) -> "ScoredGroups":
        parts = [p for p in parts if p.num_groups] or parts[:1]
        compute = None if any(p.compute is None for p in parts) else torch.cat([p.compute for p in parts])
        return cls(LearnerBatch.cat([p.batch for p in parts], pad_id), torch.cat([p.rewards for p in parts]),
                   torch.cat([p.uniform for p in parts]), parts[0].group_size,
                   [t for p in parts for t in p.task_ids], [s for p in parts for s in p.prompt_seeds], compute)


def compute_penalty(rollout: RolloutBatch, cost: float) -> torch.Tensor:
    """(R,) float64: ``cost`` · (mean recorded exit step t* over the row's sampled tokens) / T —
    the price of the compute a completion used, from 0 (never) to ``cost`` (every token ran all
    T loops); forced tokens (no exit) do not count, and a row without sampled tokens costs 0."""
    mask = rollout.action_mask
    steps = (rollout.exit_steps.double() * mask).sum(dim=1)
    mean_exit = steps / mask.sum(dim=1).clamp_min(1).double()
    return float(cost) * mean_exit / rollout.num_loops


def score_groups(scored: ScoredRollout, scale: str = "group", penalty: torch.Tensor | None = None,
                 batch: LearnerBatch | None = None, prompt_seeds: list[int] | None = None, *,
                 estimator: str = "grpo", compute_cost: float = 0.0, compute_price: str = "reward") -> ScoredGroups:
    """The learner rows of ``scored`` with their advantages (``estimator`` of
    `rltt.objectives.ADVANTAGE_ESTIMATORS`, normalised by ``scale``), computed here once.

    ``penalty`` (R,): subtracted from the rewards the advantages are computed from (the KL in
    the reward); ``compute_cost`` λ > 0 subtracts `compute_penalty` as well — from the rewards
    (``compute_price="reward"``) or, centred per group and unscaled, from the advantages of the
    rewards without it (``"advantage"``). The uniform-group
    flags stay those of the task rewards, so dynamic sampling drops the groups without a task
    signal either way. ``batch``: the rows' `LearnerBatch.from_rollout`, when already built (to
    compute the penalty)."""
    G = scored.group_size
    rewards = scored.rewards.float()  # advantages in fp32, like the learner's losses
    compute = compute_penalty(scored.rollout, compute_cost) if compute_cost > 0 else None
    shaped = rewards if penalty is None else rewards - penalty.float()
    if compute_price not in COMPUTE_PRICES:
        raise ValueError(f"compute_price: one of {' | '.join(COMPUTE_PRICES)}, got {compute_price!r}")
    if compute is None:
        adv = group_advantages(shaped, G, scale, estimator=estimator)
        advantages = adv.advantages.float()
        uniform = adv.uniform if penalty is None else uniform_groups(rewards, G)
    else:
        advantages = COMPUTE_PRICES[compute_price](shaped, compute.float(), G, scale, estimator).float()
        uniform = uniform_groups(rewards, G)
    if batch is None:
        batch = LearnerBatch.from_rollout(scored.rollout, advantages)
    else:
        batch = replace(batch, advantages=advantages)
    return ScoredGroups(batch, rewards, uniform, G, [t.id for t in scored.tasks], list(prompt_seeds or []),
                        compute)

