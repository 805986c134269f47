"""`LearnerBatch`: what flows from the rollout (plus rewards and advantages) into the learner."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class LearnerBatch:
    """B full sequences (prompt + completion, right-padded to S).

    Token-aligned tensors (B, S) describe the token *at* each position: ``target_mask`` marks
    completion tokens (the ones scored), ``exit_steps`` their recorded exit step t* (1-based;
    1 elsewhere), ``sampler_logprobs`` the sampler's tempered ``log P^(t*)(y)``.
    """

    input_ids: torch.Tensor  # (B, S) long
    attention_mask: torch.Tensor  # (B, S) long/bool
    target_mask: torch.Tensor  # (B, S) bool
    exit_steps: torch.Tensor  # (B, S) long
    advantages: torch.Tensor  # (B,) float
    sampler_logprobs: torch.Tensor | None = None  # (B, S) float
    old_logprobs: torch.Tensor | None = None  # (B, S) learner's log-prob at the rollout weights
    ref_logprobs: torch.Tensor | None = None  # (B, S) reference model's log-prob (for KL)
    temperature: float = 1.0

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor | slice) -> "LearnerBatch":
        """The sub-batch of the given rows (tensors indexed, scalars kept)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value[rows] if isinstance(value, torch.Tensor) else value
        return LearnerBatch(**out)

    def micro_batches(self, size: int):
        for start in range(0, self.size, size):
            yield self.select(slice(start, start + size))

    def to(self, device: torch.device | str) -> "LearnerBatch":
        changes = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **changes)
