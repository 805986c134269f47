"""From rollouts to learner batches: reward scoring, groups, dynamic sampling, padding."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rltt.data.rewards import RewardError, RewardRunner, RewardSample
from rltt.learner.batch import LearnerBatch
from rltt.orchestration.prompts import Task
from rltt.rollout import RolloutBatch


@dataclass
class Completion:
    """One sampled completion with what the learner and the metrics need."""

    prompt_ids: list[int]
    completion_ids: list[int]
    exit_steps: list[int]
    sampler_logprobs: list[float]  # tempered log P^(t*)(y) of the sampler
    text: str
    finish_reason: str
    task_id: str


@dataclass
class ScoredGroups:
    """G completions per prompt (prompt-major rows) and their rewards."""

    completions: list[Completion] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    per_fn: dict[str, list[float]] = field(default_factory=dict)
    errors: list[RewardError] = field(default_factory=list)
    group_size: int = 1

    @property
    def num_groups(self) -> int:
        return len(self.completions) // self.group_size

    def extend(self, other: "ScoredGroups") -> None:
        self.completions += other.completions
        self.rewards += other.rewards
        for name, values in other.per_fn.items():
            self.per_fn.setdefault(name, []).extend(values)
        self.errors += other.errors

    def select_groups(self, groups: list[int]) -> "ScoredGroups":
        G = self.group_size
        rows = [g * G + i for g in groups for i in range(G)]
        return ScoredGroups(
            completions=[self.completions[r] for r in rows],
            rewards=[self.rewards[r] for r in rows],
            per_fn={k: [v[r] for r in rows] for k, v in self.per_fn.items()},
            errors=self.errors,
            group_size=G,
        )


def score_rollout(rollout: RolloutBatch, tasks: list[Task], decode, runner: RewardRunner) -> ScoredGroups:
    """Decode every completion of ``rollout`` (rows prompt-major) and score it against its task."""
    completions, samples = [], []
    for r in range(rollout.num_rows):
        task = tasks[int(rollout.prompt_index[r])]
        n = int(rollout.completion_lengths[r])
        ids = rollout.completion_ids[r, :n].tolist()
        text = decode(ids)
        completions.append(Completion(
            prompt_ids=list(task.prompt_ids), completion_ids=ids, exit_steps=rollout.exit_steps[r, :n].tolist(),
            sampler_logprobs=rollout.tempered_logprobs[r, :n].tolist(), text=text,
            finish_reason=rollout.finish_reasons[r], task_id=task.id))
        samples.append(RewardSample(text, task.answer, task.id))
    result = runner.score(samples)
    return ScoredGroups(completions, list(result.total), {k: list(v) for k, v in result.scores.items()},
                        list(result.errors), rollout.params.n)


def to_learner_batch(groups: ScoredGroups, advantages: torch.Tensor, temperature: float,
                     pad_id: int = 0) -> LearnerBatch:
    """Right-padded prompt + completion rows with the completion tokens marked for scoring."""
    rows = groups.completions
    width = max(len(c.prompt_ids) + len(c.completion_ids) for c in rows)
    B = len(rows)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    target = torch.zeros((B, width), dtype=torch.bool)
    exits = torch.ones((B, width), dtype=torch.long)
    sampler = torch.zeros((B, width), dtype=torch.float32)
    for r, c in enumerate(rows):
        p, n = len(c.prompt_ids), len(c.completion_ids)
        ids[r, : p + n] = torch.tensor(c.prompt_ids + c.completion_ids, dtype=torch.long)
        attn[r, : p + n] = 1
        target[r, p: p + n] = True
        if n:
            exits[r, p: p + n] = torch.tensor(c.exit_steps, dtype=torch.long)
            sampler[r, p: p + n] = torch.tensor(c.sampler_logprobs, dtype=torch.float32)
    return LearnerBatch(input_ids=ids, attention_mask=attn, target_mask=target, exit_steps=exits,
                        advantages=advantages.float(), sampler_logprobs=sampler, temperature=temperature)


def solved(groups: ScoredGroups, primary: str) -> list[bool]:
    """A completion is solved when the primary (first) reward function gives it ≥ 1."""
    return [score >= 1.0 for score in groups.per_fn[primary]]
