"""Exact log-probs for the learner: bitwise schedule replay, dense recompute, hybrid log-prob.

- `replay_logprobs(model, batch)` re-executes the recorded passes of a native rollout with the
  recorded tokens and exits in place of the sampling decisions. The passes run through the
  same `PassExecutor` with the same batch composition, so at the rollout's weights the result
  equals ``batch.logprobs`` / ``batch.tempered_logprobs`` bit for bit (fp32 and bf16, dense and
  deferred). With new weights it gives the sampler-side log-prob of the new policy.
- `dense_logprobs(model, batch)` runs the model's full forward on prompt + completion and
  returns the per-loop log-probs LP (T, R, C) of the completion tokens (via the per-loop
  kernels of `rltt.kernels`), the exit distribution and the replayed exit-step log-prob —
  the learner's differentiable ``logp_dense(θ)``.
- `rollout_hybrid_logprob` is SPEC §2.4's hybrid log-prob with the rollout's recorded
  log-probs (a wrapper of `rltt.objectives.logprob.hybrid_logprob`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltt.errors import RlttError
from rltt.model.modeling import LoopedForCausalLM
from rltt.objectives.logprob import hybrid_logprob
from rltt.rollout.batch import RolloutBatch
from rltt.rollout.executor import PassExecutor
from rltt.rollout.sampler import logprobs_of

__all__ = ["DenseLogprobs", "ReplayLogprobs", "dense_logprobs", "hybrid_logprob", "replay_logprobs",
           "rollout_hybrid_logprob"]


@dataclass
class ReplayLogprobs:
    """Replayed sampling log-probs, laid out like ``batch.logprobs`` (R, C) fp32, 0 on padding."""

    logprobs: torch.Tensor
    tempered_logprobs: torch.Tensor


@dataclass
class DenseLogprobs:
    """Full-forward log-probs of a batch's completion tokens (R rows, C completion columns).

    ``per_loop`` (T, R, C): log P^(t)(y); ``exit_probs`` (T, R, C): p_t of the producing state;
    ``exit`` (R, C): per_loop at the recorded t* (SPEC §2.3 ``exit``); all 0 on padding."""

    per_loop: torch.Tensor
    exit_probs: torch.Tensor
    exit: torch.Tensor


@torch.no_grad()
def replay_logprobs(model: LoopedForCausalLM, batch: RolloutBatch) -> ReplayLogprobs:
    """Re-execute ``batch.schedule`` with ``model`` and return the sampling log-probs it gives."""
    cfg = model.config
    if batch.schedule.kind == "vllm":
        raise RlttError("replay: a vLLM rollout has no pass record to replay (vLLM batches requests its own way); "
                        "score it with dense_logprobs")
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


def dense_logprobs(model: LoopedForCausalLM, batch: RolloutBatch, temperature: float = 1.0) -> DenseLogprobs:
    """The learner's log-probs of the completion tokens from one full forward (differentiable).

    Rows are right-padded (prompt + completion); the exit step log-prob uses the recorded t*
    (schedule replay: the learner never re-decides exits)."""
    ids, mask, start = batch.padded_sequences()
    device = model.lm_head.weight.device
    cmask = batch.completion_mask.to(device)
    # the model's score mode (the learner's path): completion token c of row r sits at start[r] + c
    positions = start[:, None] + torch.arange(cmask.shape[1])[None, :]
    score_mask = torch.zeros(ids.shape, dtype=torch.bool)
    score_mask.scatter_(1, positions.clamp_max(ids.shape[1] - 1), batch.completion_mask)
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), score_mask=score_mask.to(device),
                temperature=temperature, use_cache=False)
    T = out.token_logprobs.shape[0]
    per_loop = out.token_logprobs.new_zeros((T, *cmask.shape)).masked_scatter(cmask[None].expand(T, -1, -1),
                                                                              out.token_logprobs)
    exit_probs = out.token_exit_probs.new_zeros((T, *cmask.shape)).masked_scatter(
        cmask[None].expand(T, -1, -1), out.token_exit_probs)
    steps = batch.exit_steps.to(device).clamp_min(1)
    exit_lp = per_loop.gather(0, (steps - 1)[None])[0].masked_fill(~cmask, 0.0)
    return DenseLogprobs(per_loop, exit_probs, exit_lp)


def rollout_hybrid_logprob(logp_dense: torch.Tensor, batch: RolloutBatch,
                           logp_dense_at_rollout: torch.Tensor | None = None, tempered: bool = False) -> torch.Tensor:
    """SPEC §2.4: ``logp_dense + sg(logp_rollout − logp_dense(θ_rollout))`` with ``logp_rollout``
    the batch's recorded sampling log-probs (``tempered`` picks the temperature-applied ones).

    ``logp_dense`` (R, C) is the learner's differentiable log-prob of the completion tokens
    (e.g. ``dense_logprobs(...).exit``); padding positions are 0 in the result."""
    recorded = batch.tempered_logprobs if tempered else batch.logprobs
    recorded = recorded.to(device=logp_dense.device)
    out = hybrid_logprob(logp_dense, recorded, logp_dense_at_rollout)
    return out.masked_fill(~batch.completion_mask.to(logp_dense.device), 0.0)
