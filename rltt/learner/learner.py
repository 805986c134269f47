"""The RL learner: owns the policy's optimisation, its frozen reference and its learned extras.

`Learner` is the interface the training step talks to (a torch process, a torchrun/DeepSpeed
group and a Ray learner group all provide it): ``update(batch) -> metrics`` (``version`` + 1
when the weights changed),
``sequence_kl``, ``rollout_state_dict() -> (version, tensors)`` for the engines, and
``save`` / ``load`` of everything a resumed run needs.

One ``update``:
1. at the rollout weights, without gradients: each token's policy log-prob (``old``), the
   sampler–learner mismatch of the exit log-prob, the reference log-prob for the KL, and the
   per-loop entropy / exit telemetry;
2. μ = ``ppo_epochs`` optimizer steps, each accumulating the loss over micro-batches
   (weighted so the sum is the batch-level aggregate, whatever the micro-batch size).

The non-finite guard: an optimizer step whose loss or gradients are not finite is skipped (no
weight or optimizer-state change; the backend decides, the same way on every rank), the
remaining epochs with it (they would see the same weights and batch), and the metrics carry
the reason under `SKIP_REASON`.

``sync/changed_frac``: the share of the trained elements whose value in the engines' dtype the
update changed. The backend compares the trained tensors it holds before and after (`watch`): of
each, at most ``WATCH_SAMPLE`` (256) evenly strided elements kept in the engines' dtype for the
length of the update — exact for smaller tensors, estimated from the sample for larger ones, each
tensor weighted by its size; about 1 KB a tensor whatever the model. ``version`` bumps only when some step was applied, so the
engines are never reloaded with the weights they already serve.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from rltt.errors import ConfigError, RlttError
from rltt.learner.backends import BACKENDS, make_backend
from rltt.learner.learner_batch import LearnerBatch
from rltt.learner.settings import AlgorithmConfig, LearnerConfig
from rltt.learner.loss import chosen_logprob, kl_logprob, rl_loss, sampler_logprob
from rltt.learner.scoring import score_tokens, unwrap
from rltt.model.adapters import (ADAPTER_DIR, adapter_norms, adapter_state_dict, adapters_disabled, attach_adapters,
                                 base_identity, freeze_base, merged_state_dict, read_peft_state, write_peft_adapter)
from rltt.model.load import check_base, read_base
from rltt.objectives import exit_choice_logprob, kl_estimate, policy_logprob
from rltt.runtime.checkpoint import BASE_FILE
from rltt.runtime.distributed import reduce_ranks, world_size
from rltt.telemetry import entropy_stats, exit_stats, mismatch_stats
from rltt.telemetry import schema as m


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(unwrap(model)).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class _LoopTelemetry:
    """Per-loop entropy, exit distribution and sampler–learner mismatch over a batch's micro-batches
    (scored at the rollout weights). The mismatch compares the ``exit`` log-prob — with
    ``algo.exit_action`` the joint one, exit log-prob included — with the sampler's."""

    def __init__(self, algo: AlgorithmConfig):
        self.algo = algo
        self.exit_lps, self.entropies, self.exits = [], [], []

    def add(self, scores) -> None:
        lp = policy_logprob("exit", scores.logprobs.detach(), exit_steps=scores.exit_steps)
        if self.algo.exit_action:
            lp = lp + exit_choice_logprob(scores.exit_probs.detach(), scores.exit_steps)
        self.exit_lps.append(scores.to_rows(lp))
        self.entropies.append(scores.entropy.detach())
        self.exits.append(scores.exit_probs.detach())

    def metrics(self, batch: LearnerBatch, world: int = 1) -> dict[str, float]:
        """Over the global batch: with ``world`` > 1 data-parallel ranks, every rank's tokens are
        concatenated in rank order first (a collective: all ranks call it)."""
        values = {"entropy": torch.cat(self.entropies, 1).cpu().T, "exit": torch.cat(self.exits, 1).cpu().T}
        sampler = sampler_logprob(batch, self.algo)
        if sampler is not None:
            mask = batch.target_mask.bool()
            values["learner"] = torch.cat(self.exit_lps)[mask].cpu()
            values["sampler"] = sampler[mask].cpu()
        values = reduce_ranks(values, "concat", world)
        out = {}
        out.update(entropy_stats(values["entropy"].T))
        out.update(exit_stats(values["exit"].T))
        if "sampler" in values:
            out.update(mismatch_stats(values["learner"], values["sampler"]))
        return out


#: cross-rank (and cross-micro-batch) reduction of each loss statistic; the others are means
#: (each rank's weighted sum is its share of the global batch times the world size)
STAT_OPS = {"ratio_max": "max", "ratio_min": "min", "correction_weight_max": "max",
            "correction_tokens": "sum", "correction_masked": "sum", "correction_weight_sum": "sum"}
#: the file of `Learner.save` holding the learner's own state
LEARNER_STATE = "learner_state.pt"
LOOP_WEIGHTS = "loop_weight_logits"
#: `Learner.sync`: what ``rollout_state_dict`` sends a LoRA learner's engines — the adapter tensors
#: alone (an engine that applies them in its passes; the base it loaded once never changes), or the
#: base with the (shared) adapters merged in (an engine that cannot apply them: vLLM)
SYNCS = ("adapters", "merged")
#: the metrics key of `Learner.update` holding why its update was skipped (a string; absent when
#: every optimizer step was applied) — the loop hands it to its `NonFiniteGuard` and never logs it
SKIP_REASON = "skip_reason"


class PolicyModule(torch.nn.Module):
    """What the optimiser trains: the policy (``module``) plus the trainable tensors the learner
    owns beside it — the learned loop weights ``loop_weight_logits`` (T,) for ω = ``learned``.
    Registered on one module, so every backend optimises and all-reduces them with the policy,
    while the policy's own ``state_dict`` keeps exactly the `LoopedForCausalLM` names."""

    def __init__(self, model: torch.nn.Module, learned_loops: int | None = None):
        super().__init__()
        self.module = model
        if learned_loops is not None:
            self.loop_weight_logits = torch.nn.Parameter(torch.zeros(learned_loops))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class Learner:
    """The RL learner of one process, or of this rank in a DeepSpeed data-parallel group.

    ``model`` is trained in place (the torch backend; cast to ``cfg.dtype``) or handed to
    DeepSpeed. ``rollout_dtype``: the dtype the engines run in (``rollout_state_dict`` casts to
    it; default: the model's dtype as given). The frozen reference (for ``kl_coef > 0`` or
    ``track_kl``) is a copy of ``model`` as given, made here: a resumed run builds its learner
    from the same starting policy, then `load`s the checkpoint. ``run_dir``: the run's directory,
    where a DeepSpeed backend writes the config it passes DeepSpeed (``deepspeed_config.json``).

    With ``cfg.lora`` (`rltt.model.adapters`): adapters are attached to ``model`` (A drawn from
    ``lora_seed``; a model that already holds them, attached by the engine's factory, is kept), every
    other parameter is frozen in its dtype, so the backends see, clip, all-reduce and optimise the
    adapters alone; the reference is ``model`` with its adapters off (no copy); ``rollout_state_dict``
    sends the adapters alone (``sync: adapters``) or the merged weights (``sync: merged``); ``save``
    writes the adapters in PEFT's format (``adapter/``) and ``base.json`` naming the base —
``base_path`` (the directory the run loaded ``model`` from; default its ``config._name_or_path``)
and a sha256 of its tensors — instead of the model's weights; ``update`` logs ``lora/*`` norms.
    """

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, algo: AlgorithmConfig, batch_size: int,
                 max_len: int, rollout_dtype: torch.dtype | None = None, run_dir: str | Path | None = None,
                 lora_seed: int = 0, sync: str = "adapters", base_path: str | None = None):
        self.cfg, self.algo, self.max_len = cfg, algo, max_len
        self.batch_size = batch_size
        self.micro = min(cfg.micro_batch_size, batch_size)
        self.accumulation = math.ceil(batch_size / self.micro)
        self.version = 0
        self.rollout_dtype = rollout_dtype or next(model.parameters()).dtype
        learned = algo.omega == "learned"
        backend = BACKENDS[cfg.backend]
        if learned and backend.partitions(cfg):
            raise ConfigError("algorithm.omega: 'learned' loop weights are not supported with learner.zero_stage=3 "
                              "(use zero_stage 0-2)")
        if sync not in SYNCS:
            raise ValueError(f"Learner: sync must be one of {SYNCS}, got {sync!r}")
        self.lora, self.sync = cfg.lora, sync
        #: LoRA: the frozen base's identity (`base_identity`: path, dtype, sha256), taken once, before any cast
        self.base: dict[str, str] | None = None
        if self.lora is not None:
            attach_adapters(model, self.lora.spec(), lora_seed)
            freeze_base(model)
            self.base = base_identity(model, base_path)
        self.has_reference = algo.kl_coef > 0 or algo.track_kl
        # LoRA: the reference is the policy with its adapters off (`_reference_scores`), no copy
        self.ref_model = frozen_copy(model) if self.has_reference and self.lora is None else None
        if cfg.activation_checkpointing:  # the policy's training forwards only (the reference is copied above)
            model.gradient_checkpointing_enable()
        policy = PolicyModule(model, model.config.num_loops if learned else None)
        if cfg.dtype == "bf16" and backend.in_place:
            policy = policy.to(torch.bfloat16)
        self.backend = make_backend(policy, cfg, self.accumulation, None if run_dir is None else Path(run_dir))
        self.model = self.backend.module  # the PolicyModule
        self.learned_logits = getattr(self.model, LOOP_WEIGHTS, None)
        if self.ref_model is not None:
            self.ref_model.to(next(self.model.parameters()).dtype)

    @property
    def policy(self) -> torch.nn.Module:
        """The `LoopedForCausalLM` being trained (partitioned under ZeRO-3)."""
        return unwrap(self.model)

    @property
    def main(self) -> bool:
        """The rank that writes the learner's files (rank 0; the only one without DeepSpeed)."""
        return self._data_parallel_world() == 1 or torch.distributed.get_rank() == 0

    def _score(self, model: torch.nn.Module, mb: LearnerBatch):
        return score_tokens(model, mb, pack=self.cfg.pack_sequences, head_dtype=self.cfg.head_dtype)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- 1. at the rollout weights ------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, batch: LearnerBatch, policy: bool = True) -> tuple[LearnerBatch, dict[str, float]]:
        """The batch with ``ref_logprobs`` and, with ``policy``, ``old_logprobs``, plus the loop
        telemetry measured at the rollout weights. (With one update per batch the training pass
        itself is at the rollout weights, so ``update`` skips the policy pass here.)"""
        olds, refs, seen = [], [], _LoopTelemetry(self.algo)
        self.model.eval()
        for mb in batch.micro_batches(self.micro):
            if policy:
                scores = self._score(self.backend.forward_model, mb)
                olds.append(scores.to_rows(chosen_logprob(scores, self.algo, self.learned_logits)))
                seen.add(scores)
            if self.has_reference:
                ref_scores = self._reference_scores(mb)
                refs.append(ref_scores.to_rows(kl_logprob(ref_scores, self.algo, self.learned_logits)))
        self.model.train()
        batch = replace(batch, old_logprobs=torch.cat(olds) if olds else None,
                        ref_logprobs=torch.cat(refs) if refs else None)
        return batch, seen.metrics(batch, self._data_parallel_world()) if policy else {}

    def _reference_scores(self, mb: LearnerBatch):
        """The reference's scores of a micro-batch: the frozen copy, or (LoRA) the policy with its
        adapters off — the base's function bit for bit (`rltt.model.adapters.adapters_disabled`)."""
        if self.lora is None:
            return self._score(self.ref_model, mb)
        with adapters_disabled(self.policy):
            return self._score(self.backend.forward_model, mb)

    @torch.no_grad()
    def sequence_kl(self, batch: LearnerBatch) -> torch.Tensor:
        """Per-sequence summed KL estimate to the reference (B,), for the KL-in-reward form."""
        if not self.has_reference:
            raise ValueError("sequence_kl needs a reference model (algorithm.kl_coef > 0 or track_kl)")
        batch = batch.to(self.device)
        current, ref = [], []
        for mb in batch.micro_batches(self.micro):
            scores, ref_scores = self._score(self.backend.forward_model, mb), self._reference_scores(mb)
            current.append(scores.to_rows(kl_logprob(scores, self.algo, self.learned_logits)))
            ref.append(ref_scores.to_rows(kl_logprob(ref_scores, self.algo, self.learned_logits)))
        per_token = kl_estimate(torch.cat(current), torch.cat(ref), self.algo.kl_estimator)
        return (per_token * batch.target_mask).sum(-1)

    def _data_parallel_world(self) -> int:
        """Ranks averaging gradients: DeepSpeed's process group; 1 for the torch backend."""
        return world_size() if BACKENDS[self.cfg.backend].data_parallel else 1

    def _size(self, batch: LearnerBatch) -> float:
        """What the aggregation averages over: tokens (token_mean) or sequences."""
        return float(batch.target_mask.sum()) if self.algo.aggregation == "token_mean" else float(batch.size)

    def _normalizer(self, batch: LearnerBatch) -> float:
        """The global batch's size (across data-parallel ranks) over the world size: DeepSpeed
        averages gradients across ranks, so a micro-batch's weight is its share of the global
        batch times the world size."""
        world = self._data_parallel_world()
        total = reduce_ranks({"size": self._size(batch)}, "sum", world)["size"]
        return max(total, 1.0) / world

    # -- 2. the updates -------------------------------------------------------------------
    def update(self, batch: LearnerBatch) -> dict[str, float]:
        """μ = ``ppo_epochs`` optimizer steps on ``batch`` (this rank's rows of the step's batch);
        returns the metrics of the global batch and bumps ``version`` when the weights changed.
        A non-finite loss or gradient skips the step and the epochs after it; the reason is
        ``metrics[SKIP_REASON]`` (the module docstring)."""
        if batch.size != self.batch_size:
            raise ValueError(f"learner: batch of {batch.size} sequences, configured for {self.batch_size} per rank")
        if batch.advantages is None:
            raise ValueError("learner: the batch has no advantages")
        batch = batch.to(self.device)
        one_pass = self.algo.ppo_epochs == 1
        batch, metrics = self.prepare(batch, policy=not one_pass)
        normalizer = self._normalizer(batch)
        seen = _LoopTelemetry(self.algo)
        applied, skipped = 0, None
        self.backend.watch(self.rollout_dtype, self.algo.ppo_epochs)
        for _ in range(self.algo.ppo_epochs):
            totals: dict[str, float] = {"loss": 0.0, "policy": 0.0, "kl": 0.0}
            losses = []
            for mb in batch.micro_batches(self.micro):
                weight = self._size(mb) / normalizer
                scores = self._score(self.backend.forward_model, mb)
                if one_pass:
                    seen.add(scores)
                out = rl_loss(scores, mb, self.algo, self.max_len, self.learned_logits)
                self.backend.backward(out.loss * weight)
                losses.append(out.loss.detach())
                totals["loss"] += float(out.loss.detach()) * weight
                totals["policy"] += float(out.policy_loss) * weight
                totals["kl"] += float(out.kl) * weight
                for key, value in out.stats.items():
                    op = STAT_OPS.get(key, "mean")
                    if op == "max":
                        totals[key] = max(totals.get(key, -math.inf), value)
                    elif op == "min":
                        totals[key] = min(totals.get(key, math.inf), value)
                    elif op == "sum":  # counts: exact over micro-batches, whatever the aggregation
                        totals[key] = totals.get(key, 0.0) + value
                    else:
                        totals[key] = totals.get(key, 0.0) + value * weight
            norms, skipped = self.backend.step(losses)
            metrics.update(norms)
            if skipped is not None:  # the weights did not move: a further epoch would repeat this one
                break
            applied += 1
        totals = reduce_ranks(totals, {key: STAT_OPS.get(key, "mean") for key in totals},
                              self._data_parallel_world())
        if one_pass:
            metrics.update(seen.metrics(batch, self._data_parallel_world()))
        metrics.update({
            m.LOSS_TOTAL: totals["loss"],
            m.LOSS_POLICY: totals["policy"],
            m.POLICY_CLIP_FRAC: totals["clip_fraction"],
            m.POLICY_RATIO_MEAN: totals["ratio_mean"],
            m.POLICY_RATIO_MAX: totals["ratio_max"],
            m.POLICY_RATIO_MIN: totals["ratio_min"],
            m.LR: self.backend.lr,
            m.SYNC_CHANGED_FRAC: self.backend.changed_fraction(),
        })
        if self.lora is not None:
            metrics.update(self._adapter_norms())
        if self.algo.correction != "none":
            kept = totals["correction_tokens"] - totals["correction_masked"]
            metrics[m.CORRECTION_MASKED_FRAC] = totals["correction_masked"] / max(totals["correction_tokens"], 1.0)
            metrics[m.CORRECTION_WEIGHT_MEAN] = totals["correction_weight_sum"] / max(kept, 1.0)
            metrics[m.CORRECTION_WEIGHT_MAX] = totals["correction_weight_max"]
        if batch.ref_logprobs is not None:
            metrics[m.KL_REF] = totals["kl"]
            metrics[m.LOSS_KL] = totals["kl"] * self.algo.kl_coef if self.algo.kl_in == "loss" else 0.0
        if skipped is not None:
            metrics[SKIP_REASON] = skipped
        if applied:
            self.version += 1
        return metrics

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter tensors (under ZeRO-3 the adapters alone are gathered: a collective)."""
        if not self.backend.partitioned:
            return adapter_state_dict(self.policy)
        import deepspeed

        params = [p for p in self.policy.parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().clone() for k, v in adapter_state_dict(self.policy).items()}

    def _adapter_norms(self) -> dict[str, float]:
        """``lora/*`` norms of the adapters (gathered under ZeRO-3: every rank calls it)."""
        if not self.backend.partitioned:
            return adapter_norms(self.policy)
        import deepspeed

        params = [p for p in self.policy.parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(params):
            return adapter_norms(self.policy)

    # -- 3. weights out, checkpoints ----------------------------------------------------------
    def rollout_state_dict(self) -> tuple[int, dict[str, torch.Tensor]]:
        """``(version, tensors)`` for `RolloutEngine.load_weights`: the policy's full tensors
        (gathered under ZeRO-3 — a collective, every rank calls it) in the engines' dtype, plus
        ``loop_weight_logits`` with learned loop weights. Tensors already in that dtype are the
        learner's own (no copy), so an engine sharing the model loads them for free. A LoRA
        learner sends its adapter tensors alone (``sync: adapters``: the engines hold the frozen
        base already) or the base with the adapters merged in (``sync: merged``)."""
        if self.lora is not None and self.sync == "adapters":
            tensors = self._adapter_tensors()
        else:
            tensors = self.backend.full_state_dict(self.policy)
            if self.lora is not None:
                tensors = merged_state_dict(tensors, self.policy.config)

        def cast(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            return t.to(self.rollout_dtype) if t.is_floating_point() else t

        out = {name: cast(t) for name, t in tensors.items()}
        if self.learned_logits is not None:
            out[LOOP_WEIGHTS] = cast(self.learned_logits).clone()
        return self.version, out

    def save(self, directory: str | Path) -> None:
        """Everything a resumed learner needs, into ``directory`` (the same path on every rank; a
        collective): the policy as a loadable model directory (weights gathered under ZeRO-3),
        the optimizer (DeepSpeed: every rank its shard), ``version`` and the learned loop weights.
        A LoRA learner writes no base weights: ``config.json``, the adapters in PEFT's format
        (``adapter/``) and ``base.json`` naming the base (`base_identity`), which
        `rltt.model.load_looped` and `load` check the base against."""
        directory = Path(directory)
        if self.lora is not None:
            weights = self._adapter_tensors()  # the adapters alone (gathered under ZeRO-3)
        else:
            weights = self.backend.full_state_dict(self.policy) if self.backend.partitioned else None
        if self.main:
            directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(directory)
        if self.main:
            if self.lora is None:
                self.policy.save_pretrained(directory, safe_serialization=True, state_dict=weights)
            else:
                self.policy.config.save_pretrained(directory)
                peft_base = getattr(self.policy.config, "_name_or_path", "")  # empty for a dense base (PEFT would misload it)
                write_peft_adapter(self.policy, directory / ADAPTER_DIR, peft_base, state=weights)
                (directory / BASE_FILE).write_text(json.dumps(self.base, indent=1) + "\n")
            state = {"version": self.version}
            if self.learned_logits is not None:
                state[LOOP_WEIGHTS] = self.learned_logits.detach().float().cpu().clone()
            torch.save(state, directory / LEARNER_STATE)
        if self._data_parallel_world() > 1:
            torch.distributed.barrier()  # the directory is complete before any rank moves on

    def checkpointed(self, directory: str | Path) -> None:
        """Nothing to note: a learner in this process is rebuilt from the checkpoint by a resume."""

    def close(self) -> None:
        """Nothing to release: the learner lives in this process (a torchrun run's process group
        is closed by its `Ranks`)."""

    def load(self, directory: str | Path) -> None:
        """Resume from a directory `save` wrote (a collective under DeepSpeed)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        if (directory / BASE_FILE).is_file():  # a LoRA checkpoint: the adapters, trained on this base
            if self.lora is None:
                raise RlttError(f"{directory}: holds LoRA adapters ({BASE_FILE}); resume it with its learner.lora")
            check_base(directory, read_base(directory), self.base)
            weights = read_peft_state(directory / ADAPTER_DIR, self.lora.spec(), self.policy.config.num_loops)
        else:
            weights = {}
            for f in sorted(directory.glob("*.safetensors")):
                weights.update(load_file(str(f)))
        if not self.backend.partitioned:  # ZeRO-3's partitions come back from its own checkpoint
            self.policy.load_state_dict(weights, strict=False)
        from rltt.runtime.checkpoint import load_state_file

        state = load_state_file(directory / LEARNER_STATE) if (directory / LEARNER_STATE).exists() else {}
        if self.learned_logits is not None and LOOP_WEIGHTS in state:
            with torch.no_grad():
                self.learned_logits.copy_(state[LOOP_WEIGHTS])
        self.backend.load(directory)
        self.version = int(state.get("version", 0))
