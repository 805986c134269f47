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

from rltt.rollout import RolloutBatch, RolloutStats, SamplingParams
from rltt.rollout.rollout_batch import join_batches


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


def merge(parts: list[RolloutBatch], params: SamplingParams, wall_time: float) -> RolloutBatch:
    """One batch of the shards' rows, in order (``params``: the call's, seed as the shards used)."""
    if len(parts) == 1:
        return parts[0]
    stats = RolloutStats.join([p.stats for p in parts], serial=False, wall_time=wall_time)
    return join_batches(parts, replace(params, seed=parts[0].params.seed), stats)
