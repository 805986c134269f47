"""The RL learner: scores a `LearnerBatch`, builds the loss and updates the policy.

One ``train_step``:
1. at the rollout weights, without gradients: each token's policy log-prob (``old``), the
   sampler–learner mismatch of the exit log-prob, the reference log-prob for the KL, and the
   per-loop entropy / exit telemetry;
2. μ = ``ppo_epochs`` optimizer steps, each accumulating the loss over micro-batches
   (weighted so the sum is the batch-level aggregate, whatever the micro-batch size).
"""

from __future__ import annotations

import copy
import math

import torch

from rltt.learner.backends import make_backend
from rltt.learner.batch import LearnerBatch
from rltt.learner.config import AlgorithmConfig, LearnerConfig
from rltt.learner.loss import chosen_logprob, kl_logprob, rl_loss
from rltt.learner.scoring import score_tokens, unwrap
from rltt.objectives import kl_estimate, policy_logprob
from rltt.telemetry import entropy_stats, exit_stats, mismatch_stats
from rltt.telemetry import schema as m


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(unwrap(model)).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class _LoopTelemetry:
    """Per-loop entropy, exit distribution and sampler–learner mismatch over a batch's micro-batches
    (scored at the rollout weights)."""

    def __init__(self):
        self.exit_lps, self.entropies, self.exits = [], [], []

    def add(self, scores) -> None:
        self.exit_lps.append(scores.to_rows(
            policy_logprob("exit", scores.logprobs.detach(), exit_steps=scores.exit_steps)))
        self.entropies.append(scores.entropy.detach())
        self.exits.append(scores.exit_probs.detach())

    def metrics(self, batch: LearnerBatch, world: int = 1) -> dict[str, float]:
        """Over the global batch: with ``world`` > 1 data-parallel ranks, every rank's tokens are
        gathered first (a collective: all ranks call it)."""
        entropies, exits = torch.cat(self.entropies, 1).cpu(), torch.cat(self.exits, 1).cpu()
        mismatch = None
        if batch.sampler_logprobs is not None:
            mask = batch.target_mask.bool()
            mismatch = (torch.cat(self.exit_lps)[mask].cpu(), batch.sampler_logprobs[mask].cpu())
        if world > 1:
            gathered = [None] * world
            torch.distributed.all_gather_object(gathered, (entropies, exits, mismatch))
            entropies = torch.cat([g[0] for g in gathered], 1)
            exits = torch.cat([g[1] for g in gathered], 1)
            if mismatch is not None:
                mismatch = tuple(torch.cat([g[2][i] for g in gathered]) for i in range(2))
        out = {}
        out.update(entropy_stats(entropies))
        out.update(exit_stats(exits))
        if mismatch is not None:
            out.update(mismatch_stats(*mismatch))
        return out


class Learner:
    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, algo: AlgorithmConfig, batch_size: int,
                 max_len: int, ref_model: torch.nn.Module | None = None):
        self.cfg, self.algo, self.max_len = cfg, algo, max_len
        self.batch_size = batch_size
        self.micro = min(cfg.micro_batch_size, batch_size)
        self.accumulation = math.ceil(batch_size / self.micro)
        needs_ref = algo.kl_coef > 0 or algo.track_kl
        self.ref_model = (ref_model or frozen_copy(model)) if needs_ref else None
        self.learned_logits = None
        if algo.omega == "learned":
            model.loop_weight_logits = torch.nn.Parameter(torch.zeros(model.config.num_loops))
            self.learned_logits = model.loop_weight_logits
        if cfg.dtype == "bf16" and cfg.backend == "torch":
            model = model.to(torch.bfloat16)
        self.backend = make_backend(model, cfg, self.accumulation)
        self.model = self.backend.module
        if self.ref_model is not None:
            self.ref_model.to(next(self.model.parameters()).dtype)

    def _score(self, model: torch.nn.Module, mb: LearnerBatch):
        return score_tokens(model, mb, pack=self.cfg.pack_sequences)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- 1. at the rollout weights ------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, batch: LearnerBatch, policy: bool = True) -> tuple[LearnerBatch, dict[str, float]]:
        """Fill ``ref_logprobs`` and, with ``policy``, ``old_logprobs`` plus the loop telemetry
        measured at the rollout weights. (With one update per batch the training pass itself is
        at the rollout weights, so ``train_step`` skips the policy pass here.)"""
        olds, refs, seen = [], [], _LoopTelemetry()
        self.model.eval()
        for mb in batch.micro_batches(self.micro):
            if policy:
                scores = self._score(self.backend.forward_model, mb)
                olds.append(scores.to_rows(chosen_logprob(scores, self.algo, self.learned_logits)))
                seen.add(scores)
            if self.ref_model is not None:
                ref_scores = self._score(self.ref_model, mb)
                refs.append(ref_scores.to_rows(kl_logprob(ref_scores, self.algo, self.learned_logits)))
        self.model.train()
        batch.old_logprobs = torch.cat(olds) if olds else None
        batch.ref_logprobs = torch.cat(refs) if refs else None
        return batch, seen.metrics(batch, self._data_parallel_world()) if policy else {}

    @torch.no_grad()
    def sequence_kl(self, batch: LearnerBatch) -> torch.Tensor:
        """Per-sequence summed KL estimate to the reference (B,), for the KL-in-reward form."""
        if self.ref_model is None:
            raise ValueError("sequence_kl needs a reference model (algorithm.kl_coef > 0 or track_kl)")
        batch = batch.to(self.device)
        current, ref = [], []
        for mb in batch.micro_batches(self.micro):
            scores, ref_scores = self._score(self.backend.forward_model, mb), self._score(self.ref_model, mb)
            current.append(scores.to_rows(kl_logprob(scores, self.algo, self.learned_logits)))
            ref.append(ref_scores.to_rows(kl_logprob(ref_scores, self.algo, self.learned_logits)))
        per_token = kl_estimate(torch.cat(current), torch.cat(ref), self.algo.kl_estimator)
        return (per_token * batch.target_mask).sum(-1)

    def _data_parallel_world(self) -> int:
        """Ranks averaging gradients: DeepSpeed's process group; 1 for the torch backend."""
        if self.cfg.backend == "deepspeed" and torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size()
        return 1

    def _size(self, batch: LearnerBatch) -> float:
        """What the aggregation averages over: tokens (token_mean) or sequences."""
        return float(batch.target_mask.sum()) if self.algo.aggregation == "token_mean" else float(batch.size)

    def _normalizer(self, batch: LearnerBatch) -> float:
        """The global batch's size (across data-parallel ranks) over the world size: DeepSpeed
        averages gradients across ranks, so a micro-batch's weight is its share of the global
        batch times the world size."""
        local, world = self._size(batch), self._data_parallel_world()
        if world > 1:
            total = torch.tensor([local], dtype=torch.float64)
            torch.distributed.all_reduce(total)
            local = float(total)
        return max(local, 1.0) / world

    def _across_ranks(self, totals: dict[str, float]) -> dict[str, float]:
        """Batch-level values: each rank's weighted sum is its share × world, so the mean over
        ranks is the global value; ``*_max`` / ``*_min`` keys take the max / min over ranks
        (identity in one process)."""
        world = self._data_parallel_world()
        if world == 1:
            return totals
        out = {}
        for op, keys in ((torch.distributed.ReduceOp.MAX, [k for k in totals if k.endswith("_max")]),
                         (torch.distributed.ReduceOp.MIN, [k for k in totals if k.endswith("_min")]),
                         (torch.distributed.ReduceOp.SUM, [k for k in totals if not k.endswith(("_max", "_min"))])):
            if not keys:
                continue
            values = torch.tensor([totals[k] for k in keys], dtype=torch.float64)
            torch.distributed.all_reduce(values, op=op)
            if op == torch.distributed.ReduceOp.SUM:
                values /= world
            out.update(zip(keys, values.tolist()))
        return out

    # -- 2. the updates -------------------------------------------------------------------
    def train_step(self, batch: LearnerBatch) -> dict[str, float]:
        if batch.size != self.batch_size:
            raise ValueError(f"learner: batch of {batch.size} sequences, configured for {self.batch_size} per rank")
        batch = batch.to(self.device)
        one_pass = self.algo.ppo_epochs == 1
        batch, metrics = self.prepare(batch, policy=not one_pass)
        normalizer = self._normalizer(batch)
        seen = _LoopTelemetry()
        for _ in range(self.algo.ppo_epochs):
            totals = {"loss": 0.0, "policy": 0.0, "kl": 0.0}
            stats: dict[str, float] = {}
            for mb in batch.micro_batches(self.micro):
                weight = self._size(mb) / normalizer
                scores = self._score(self.backend.forward_model, mb)
                if one_pass:
                    seen.add(scores)
                out = rl_loss(scores, mb, self.algo, self.max_len, self.learned_logits)
                self.backend.backward(out.loss * weight)
                totals["loss"] += float(out.loss.detach()) * weight
                totals["policy"] += float(out.policy_loss) * weight
                totals["kl"] += float(out.kl) * weight
                for key, value in out.stats.items():
                    if key.endswith("_max"):
                        stats[key] = max(stats.get(key, -math.inf), value)
                    elif key.endswith("_min"):
                        stats[key] = min(stats.get(key, math.inf), value)
                    else:
                        stats[key] = stats.get(key, 0.0) + value * weight
            metrics.update(self.backend.step())
        totals = self._across_ranks(totals)
        stats = self._across_ranks(stats)
        if one_pass:
            metrics.update(seen.metrics(batch, self._data_parallel_world()))
        metrics.update({
            m.LOSS_TOTAL: totals["loss"],
            m.LOSS_POLICY: totals["policy"],
            m.POLICY_CLIP_FRAC: stats["clip_fraction"],
            m.POLICY_RATIO_MEAN: stats["ratio_mean"],
            m.POLICY_RATIO_MAX: stats["ratio_max"],
            m.POLICY_RATIO_MIN: stats["ratio_min"],
            m.LR: self.backend.lr,
        })
        if batch.ref_logprobs is not None:
            metrics[m.KL_REF] = totals["kl"]
            metrics[m.LOSS_KL] = totals["kl"] * self.algo.kl_coef if self.algo.kl_in == "loss" else 0.0
        return metrics

    def state_dict_for_rollout(self) -> dict[str, torch.Tensor]:
        """The weights the rollout engines load (full tensors, even under ZeRO-3)."""
        model = unwrap(self.model)
        if self.cfg.backend == "deepspeed" and self.cfg.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(model.parameters())):
                return {k: v.detach().clone() for k, v in model.state_dict().items()}
        return model.state_dict()
