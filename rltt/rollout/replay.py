"""Bitwise schedule replay: the rollout's sampling log-probs recomputed from its recorded passes.

`replay_logprobs(model, batch)` re-executes the recorded passes of a native rollout with the
recorded tokens and exits in place of the sampling decisions. The passes run through the same
`PassExecutor` with the same batch composition, so at the rollout's weights the result equals
``batch.logprobs`` / ``batch.tempered_logprobs`` bit for bit (fp32 and bf16, dense and
deferred). With new weights it gives the sampler-side log-prob of the new policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltt.errors import RlttError
from rltt.model.modeling import LoopedForCausalLM
from rltt.rollout.rollout_batch import RolloutBatch
from rltt.rollout.executor import PassExecutor
from rltt.rollout.sampler import logprobs_of

__all__ = ["ReplayLogprobs", "replay_logprobs"]


@dataclass
class ReplayLogprobs:
    """Replayed sampling log-probs, laid out like ``batch.logprobs`` (R, C) fp32, 0 on padding."""

    logprobs: torch.Tensor
    tempered_logprobs: torch.Tensor


@torch.no_grad()
def replay_logprobs(model: LoopedForCausalLM, batch: RolloutBatch) -> ReplayLogprobs:
    """Re-execute ``batch.schedule`` with ``model`` and return the sampling log-probs it gives."""
    cfg = model.config
    if not batch.schedule.replayable:
        raise RlttError("replay: a vLLM rollout has no pass record to replay (vLLM batches requests its own way); "
                        "the learner scores it with its dense forward at the recorded exits")
    if cfg.num_loops != batch.num_loops:
        raise RlttError(f"replay: the model has num_loops={cfg.num_loops}, the rollout {batch.num_loops}")
    lengths = batch.prompt_lengths.tolist()
    num_rows = batch.num_rows
    executor = PassExecutor(model, num_rows, max(lengths) + batch.completion_ids.shape[1])
    for r in range(num_rows):
        seq = batch.sequence(r)
        executor.tokens[r, : len(seq)] = torch.tensor(seq)
    raw = torch.zeros(batch.logprobs.shape, dtype=torch.float32)
    tempered = torch.zeros_like(raw)
    temperature = batch.params.temperature
    for record in batch.schedule.passes:
        rows, starts, ends, steps = record.work.T.tolist()
        h, _, last = executor.run(rows, starts, ends, steps)
        if record.fork is not None:
            executor.fork(record.fork.tolist())
        if not record.exits.numel():
            continue
        where = {r: i for i, r in enumerate(rows)}
        chosen = [where[r] for r in record.exits.tolist()]
        logits = executor.logits(h[last[torch.tensor(chosen)]])
        exit_rows = record.exits.to(executor.device)
        positions = torch.tensor([ends[i] + 1 for i in chosen], device=executor.device)
        targets = executor.tokens[exit_rows, positions]
        lp_raw, lp_tempered = logprobs_of(logits, targets, temperature)
        columns = positions.cpu() - batch.prompt_lengths[record.exits]
        raw[record.exits, columns] = lp_raw.cpu()
        tempered[record.exits, columns] = lp_tempered.cpu()
    return ReplayLogprobs(raw, tempered)
