"""Splitting one `generate` call into per-worker shards and merging their batches back.

A shard is a contiguous range of prompts with their own prompt seeds, so a row's tokens (a pure
function of the weights, its prompt, its prompt seed and its sample index) are what the unsharded
call gives. The merged `RolloutBatch` lists the shards' rows in prompt order; its schedule holds
each shard's passes in turn with rows renumbered and each shard's chunks
(`rltt.rollout.rollout_batch.join_schedules`, as a native engine joins its ``chunk_rows``
chunks), so replay runs every shard on its own rows; its stats count serial passes as the
slowest shard's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rltt.rollout import RolloutBatch, RolloutStats, SamplingParams
from rltt.rollout.rollout_batch import join_schedules


def split(num_prompts: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous, non-empty ``(start, end)`` prompt ranges, at most ``workers`` of them, sizes
    differing by at most one."""
    parts = min(workers, num_prompts)
    base, extra = divmod(num_prompts, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        out.append((start, end))
        start = end
    return out


def shard_params(params: SamplingParams, start: int, end: int) -> SamplingParams:
    return replace(params, prompt_seeds=list(params.prompt_seeds[start:end]))


def _pad(t: torch.Tensor, width: int, value) -> torch.Tensor:
    if t.shape[-1] == width:
        return t
    pad = torch.full((*t.shape[:-1], width - t.shape[-1]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=-1)


def merge(parts: list[RolloutBatch], params: SamplingParams, wall_time: float) -> RolloutBatch:
    """One batch of the shards' rows, in order (``params``: the call's, seed as the shards used)."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.completion_ids.shape[1] for p in parts)
    prompts, index = [], []
    for p in parts:
        index.append(p.prompt_index + len(prompts))
        prompts.extend(p.prompts)

    def cat(name: str, value) -> torch.Tensor:  # (R, C) tensors, padded to the widest shard
        return torch.cat([_pad(getattr(p, name), width, value) for p in parts])

    gates = torch.cat([_pad(p.gate_probs, width, float("nan")) for p in parts], dim=1)
    stats = RolloutStats.join([p.stats for p in parts], serial=False, wall_time=wall_time)
    first = parts[0]
    return RolloutBatch(
        prompts=prompts, prompt_index=torch.cat(index), prompt_lengths=torch.cat([p.prompt_lengths for p in parts]),
        completion_ids=cat("completion_ids", first.pad_id), completion_lengths=torch.cat(
            [p.completion_lengths for p in parts]),
        completion_mask=cat("completion_mask", False), exit_steps=cat("exit_steps", 0),
        logprobs=cat("logprobs", 0.0), tempered_logprobs=cat("tempered_logprobs", 0.0), gate_probs=gates,
        forced_mask=cat("forced_mask", False),  # forced (thinking-budget) tokens stay non-actions
        kept_floor=cat("kept_floor", -1),  # the kept set (top-k/top-p) each token was drawn from
        exit_logprobs=cat("exit_logprobs", 0.0),  # log p_{t*}: the sampler's, as recorded
        finish_reasons=[f for p in parts for f in p.finish_reasons], schedule=join_schedules(
            [p.schedule for p in parts], [p.num_rows for p in parts]),
        params=replace(params, seed=first.params.seed), stats=stats, num_loops=first.num_loops, dtype=first.dtype,
        pad_id=first.pad_id,  # each token's weights version, when every part recorded them
        versions=cat("versions", -1) if all(p.versions is not None for p in parts) else None)
