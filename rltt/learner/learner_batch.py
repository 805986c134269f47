"""`LearnerBatch`: what flows from the rollout (plus rewards and advantages) into the learner."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class LearnerBatch:
    """B full sequences (prompt + completion, right-padded to S).

    Token-aligned tensors (B, S) describe the token *at* each position: ``target_mask`` marks
    completion tokens (the ones scored), ``exit_steps`` their recorded exit step t* (1-based;
    1 elsewhere), ``sampler_logprobs`` the sampler's tempered ``log P^(t*)(y)`` (of the
    distribution the token was drawn from: truncated by top-k/top-p where it was), ``kept_floor``
    the kept-set floor token of that truncation (-1: none; `RolloutBatch.kept_floor`) — the learner
    renormalises its log-probs over the tokens it scores at least as high as that token
    (docs/design.md §3.6), on its logits rounded to ``kept_dtype``, the dtype of the logits the
    sampler took the set from (`RolloutBatch.dtype`; None: fp32); ``sampler_exit_logprobs`` the sampler's ``log p_{t*}`` of the recorded
    exit (`RolloutBatch.exit_logprobs`), the exit half of the joint log-prob of
    ``algorithm.exit_action`` (docs/design.md §5.12).

    ``env_mask`` (B, S) bool marks the tokens the environment wrote in a multi-turn episode (tool
    results, user messages; `RolloutBatch.env_mask`): attended to like the prompt, never targets —
    no loss, ratio, KL or mismatch, and not counted by any loss aggregation. None: none (a
    single-turn batch). A batch whose ``target_mask`` marks an environment token is an error.

    ``versions`` the weights version that sampled each target token (-1 elsewhere; None: not
    recorded): a partial rollout's rows mix versions, and the per-token staleness is the learner's
    version minus it (``orchestration.partial_rollouts``, docs/async.md).

    ``head_dtype`` is not carried here: it is the learner's setting (`LearnerConfig.lm_head_dtype`).
    """

    input_ids: torch.Tensor  # (B, S) long
    attention_mask: torch.Tensor  # (B, S) long/bool
    target_mask: torch.Tensor  # (B, S) bool
    exit_steps: torch.Tensor  # (B, S) long
    advantages: torch.Tensor | None = None  # (B,) float; set once per step, before the update
    sampler_logprobs: torch.Tensor | None = None  # (B, S) float
    sampler_exit_logprobs: torch.Tensor | None = None  # (B, S) float: the sampler's log p_{t*} (exit_action)
    old_logprobs: torch.Tensor | None = None  # (B, S) learner's log-prob at the rollout weights
    ref_logprobs: torch.Tensor | None = None  # (B, S) reference model's log-prob (for KL)
    temperature: float = 1.0
    kept_floor: torch.Tensor | None = None  # (B, S) long; -1 = the whole vocabulary (None: all -1)
    kept_dtype: torch.dtype | None = None  # the sampler's logits' dtype when it took the kept sets (None: fp32)
    versions: torch.Tensor | None = None  # (B, S) long: the weights version of each target token (-1 elsewhere)
    env_mask: torch.Tensor | None = None  # (B, S) bool: environment-written tokens (never targets; None: none)

    def __post_init__(self) -> None:
        if self.env_mask is not None and bool((self.env_mask.bool() & self.target_mask.bool()).any()):
            raise ValueError("LearnerBatch: target_mask marks environment tokens (env_mask); only the model's "
                             "sampled tokens are targets")

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

    @classmethod
    def from_rollout(cls, rollout, advantages: torch.Tensor | None = None) -> "LearnerBatch":
        """The rows of a `RolloutBatch` as the learner scores them: prompt + completion, right-padded
        (`RolloutBatch.padded_sequences`), the completion tokens marked, with their recorded exit
        steps and the sampler's tempered log-probs at their positions. Forced tokens
        (``rollout.forced_mask``) are input like the prompt, never targets: no policy loss, KL,
        entropy or log-prob mismatch on them; so are environment tokens (``rollout.env_mask``),
        marked in ``env_mask``."""
        ids, attention, start = rollout.padded_sequences()
        rows, width = rollout.completion_ids.shape
        keep = rollout.action_mask
        row = torch.arange(rows)[:, None].expand(rows, width)[keep]
        pos = (start[:, None] + torch.arange(width)[None, :])[keep]
        target = torch.zeros(ids.shape, dtype=torch.bool)
        target[row, pos] = True
        exits = torch.ones(ids.shape, dtype=torch.long)
        exits[row, pos] = rollout.exit_steps[keep]
        sampler = torch.zeros(ids.shape, dtype=torch.float32)
        sampler[row, pos] = rollout.tempered_logprobs[keep].float()
        sampler_exit = torch.zeros(ids.shape, dtype=torch.float32)
        sampler_exit[row, pos] = rollout.exit_logprobs[keep].float()
        versions = None
        if rollout.versions is not None:
            versions = torch.full(ids.shape, -1, dtype=torch.long)
            versions[row, pos] = rollout.versions[keep].long()
        floors = None
        if rollout.kept_floor is not None and bool((rollout.kept_floor[keep] >= 0).any()):
            floors = torch.full(ids.shape, -1, dtype=torch.long)
            floors[row, pos] = rollout.kept_floor[keep]
        env = None
        if bool(rollout.env_mask.any()):
            written = rollout.completion_mask & rollout.env_mask
            env = torch.zeros(ids.shape, dtype=torch.bool)
            env[torch.arange(rows)[:, None].expand(rows, width)[written],
                (start[:, None] + torch.arange(width)[None, :])[written]] = True
        return cls(input_ids=ids, attention_mask=attention, target_mask=target, exit_steps=exits,
                   advantages=None if advantages is None else advantages.float(), sampler_logprobs=sampler,
                   sampler_exit_logprobs=sampler_exit, versions=versions,
                   temperature=rollout.params.temperature, kept_floor=floors,
                   kept_dtype=None if floors is None else rollout.dtype, env_mask=env)

    @classmethod
    def cat(cls, batches: list["LearnerBatch"], pad_id: int = 0) -> "LearnerBatch":
        """The rows of ``batches`` in order, right-padded to the widest (padding as `from_rollout`)."""
        width = max(b.input_ids.shape[1] for b in batches)
        fill = {"input_ids": pad_id, "attention_mask": 0, "target_mask": False, "exit_steps": 1, "versions": -1,
                "sampler_logprobs": 0.0, "sampler_exit_logprobs": 0.0, "old_logprobs": 0.0, "ref_logprobs": 0.0,
                "kept_floor": -1, "env_mask": False}
        out = {}
        for f in fields(cls):
            values = [getattr(b, f.name) for b in batches]
            if f.name == "versions" and any(v is not None for v in values):  # a batch without: not recorded
                values = [torch.full(b.input_ids.shape, -1, dtype=torch.long) if v is None else v
                          for b, v in zip(batches, values)]
            if f.name == "kept_floor" and any(v is not None for v in values):  # a batch without: no truncation
                values = [torch.full(b.input_ids.shape, -1, dtype=torch.long) if v is None else v
                          for b, v in zip(batches, values)]
            if f.name == "env_mask" and any(v is not None for v in values):  # a batch without: no env tokens
                values = [torch.zeros(b.input_ids.shape, dtype=torch.bool) if v is None else v
                          for b, v in zip(batches, values)]
            if f.name in fill and values[0] is not None:
                out[f.name] = torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1]), value=fill[f.name])
                                         for v in values])
            elif f.name == "advantages" and values[0] is not None:
                out[f.name] = torch.cat(values)
            elif f.name == "kept_dtype":  # batches without truncation say none
                out[f.name] = next((v for v in values if v is not None), None)
            else:
                out[f.name] = values[0]
        return cls(**out)

    def micro_batches(self, size: int):
        for start in range(0, self.size, size):
            yield self.select(slice(start, start + size))

    def to(self, device: torch.device | str) -> "LearnerBatch":
        changes = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                   if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **changes)
