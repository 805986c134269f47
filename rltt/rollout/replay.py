"""Bitwise schedule replay: the rollout's sampling log-probs recomputed from its recorded passes.

`replay_logprobs(model, batch)` re-executes the recorded passes of a native rollout with the
recorded tokens, exits and kept sets (top-k/top-p) in place of the sampling decisions. The passes run through the same
`PassExecutor` with the same batch composition (`_replay_span`, one driver for every record the
decode loop writes) — a record of several chunks (`Schedule.chunks`: a
chunked native call, a Ray pool's shards) chunk by chunk, each on an executor of its own rows — so
at the rollout's weights the result equals ``batch.logprobs`` / ``batch.tempered_logprobs`` bit
for bit (fp32 and bf16, dense and deferred), and so do the gates the passes compute, hence the
exit log-probs ``log p_{t*}`` (``batch.exit_logprobs``). With new weights it gives the sampler-side
log-probs of the new policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltt.errors import RlttError
from rltt.model.exits import exit_logprob
from rltt.model.modeling import LoopedForCausalLM
from rltt.rollout.attention import PassSetup
from rltt.rollout.rollout_batch import RolloutBatch
from rltt.rollout.executor import PassExecutor
from rltt.rollout.sampler import logprobs_of

__all__ = ["ReplayLogprobs", "replay_logprobs"]


@dataclass
class ReplayLogprobs:
    """Replayed sampling log-probs, laid out like ``batch.logprobs`` (R, C) fp32, 0 on padding;
    ``exit_logprobs``: the replayed ``log p_{t*}`` of the recorded exits (as ``batch.exit_logprobs``)."""

    logprobs: torch.Tensor
    tempered_logprobs: torch.Tensor
    exit_logprobs: torch.Tensor


@torch.no_grad()
def replay_logprobs(model: LoopedForCausalLM, batch: RolloutBatch, buckets=None) -> ReplayLogprobs:
    """Re-execute ``batch.schedule`` with ``model`` and return the sampling log-probs it gives, with
    the attention implementation the rollout recorded (resolved once here) and ``buckets`` — the
    sampling engine's CUDA-graph buckets (``engine.buckets``) to re-run bucketed passes as they ran;
    None: unpadded passes (the same values where bucketed = unbucketed holds)."""
    cfg = model.config
    if not batch.schedule.replayable:
        raise RlttError("replay: a vLLM rollout has no pass record to replay (vLLM batches requests its own way); "
                        "the learner scores it with its dense forward at the recorded exits")
    if cfg.num_loops != batch.num_loops:
        raise RlttError(f"replay: the model has num_loops={cfg.num_loops}, the rollout {batch.num_loops}")
    raw = torch.zeros(batch.logprobs.shape, dtype=torch.float32)
    tempered = torch.zeros_like(raw)
    gates = torch.full(batch.gate_probs.shape, float("nan"), dtype=torch.float32)
    try:
        spans = batch.schedule.chunk_spans(batch.num_rows)
    except ValueError as e:
        raise RlttError(f"replay: {e}") from None
    # the rollout's attention implementation: another one rounds differently
    setup = PassSetup.of(batch.schedule.attention, model.lm_head.weight.device, buckets)
    for first, end, pass_first, pass_end in spans:
        _replay_span(model, batch, first, end, batch.schedule.passes[pass_first:pass_end], raw, tempered, gates,
                     setup)
    return ReplayLogprobs(raw, tempered, exit_logprob(gates, batch.exit_steps, batch.action_mask).cpu())


def _replay_span(model: LoopedForCausalLM, batch: RolloutBatch, first: int, end: int, passes: list,
                 raw: torch.Tensor, tempered: torch.Tensor, gates: torch.Tensor, setup: PassSetup) -> None:
    """Re-execute the passes of the rows ``first..end-1`` (one decode loop's record, its slots numbered
    from ``first``) on an executor of its slots, as the loop ran them: a record without admissions
    seated every row in its own slot before the first pass (`rltt.rollout.admission.SeatAll`); one
    with admissions seats each recorded row before its pass — its whole sequence written, the shared
    prefix copied as recorded. Then each pass's work, forks and exits (slots mapped to the rows they
    hold). A row's gates are read when it leaves its slot or at the end."""
    if end == first:
        return
    admitting = any(p.admit is not None for p in passes)
    num_slots = (1 + max(int(p.admit[:, 0].max()) for p in passes if p.admit is not None) - first if admitting
                 else end - first)
    lengths = batch.prompt_lengths[first:end]
    width = max(1, int(batch.completion_lengths[first:end].max()))
    executor = PassExecutor(model, num_slots, int(lengths.max()) + width, setup)
    truncated = bool((batch.kept_floor[first:end] >= 0).any())  # else no floor to apply (logprobs_of)
    holder = [-1] * num_slots  # the batch row in each slot
    if not admitting:
        for r in range(first, end):
            seq = batch.sequence(r)
            executor.tokens[r - first, : len(seq)] = torch.tensor(seq)
            holder[r - first] = r

    def leave(slot: int) -> None:  # the state before completion token j sits at position prompt + j − 1
        r = holder[slot]
        n, start = int(batch.completion_lengths[r]), int(batch.prompt_lengths[r]) - 1
        gates[:, r, :n] = executor.gates[:, slot, start:start + n].cpu()

    for record in passes:
        if record.admit is not None:
            for slot, row, src, length in record.admit.tolist():  # the batch's numbering (src −1: none)
                slot, src = slot - first, (src - first if src >= 0 else -1)
                if holder[slot] >= 0:
                    leave(slot)
                holder[slot] = row
                executor.admit(slot, batch.sequence(row), src, length)
        _replay_pass(executor, batch, record, first, lambda local: torch.tensor([holder[s] for s in local]),
                     truncated, raw, tempered)
    for slot in range(num_slots):
        if holder[slot] >= 0:
            leave(slot)


def _replay_pass(executor: PassExecutor, batch: RolloutBatch, record, first: int, held, truncated: bool,
                 raw: torch.Tensor, tempered: torch.Tensor) -> None:
    """Re-execute one recorded pass (its rows numbered from ``first``): its work, its forks, then the
    log-probs of its exits — the executor rows whose decode token exited (``held(local)``: the batch
    rows they hold), their tokens read from the executor at the position after their item's last,
    written into ``raw`` / ``tempered`` at the batch's completion columns, with the kept set of
    top-k/top-p the rollout recorded."""
    rows, starts, ends, steps = record.work.T.tolist()
    if first:
        rows = [r - first for r in rows]
    h, _, last = executor.run(rows, starts, ends, steps)
    if record.fork is not None:
        executor.fork([[src - first, dst - first, n] for src, dst, n in record.fork.tolist()])
    if not record.exits.numel():
        return
    local = (record.exits - first).tolist()
    batch_rows = held(local)
    where = {r: i for i, r in enumerate(rows)}
    chosen = [where[r] for r in local]
    logits = executor.logits(h[last[torch.tensor(chosen)]])
    positions = torch.tensor([ends[i] + 1 for i in chosen], device=executor.device)
    targets = executor.tokens[torch.tensor(local, device=executor.device), positions]
    columns = positions.cpu() - batch.prompt_lengths[batch_rows]
    floors = batch.kept_floor[batch_rows, columns].to(executor.device) if truncated else None
    lp_raw, lp_tempered = logprobs_of(logits, targets, batch.params.temperature, floors)
    raw[batch_rows, columns] = lp_raw.cpu()
    tempered[batch_rows, columns] = lp_tempered.cpu()
