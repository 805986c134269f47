"""The training loop shared by ``rltt pretrain`` and ``rltt convert``.

:func:`run_stage` takes a checked recipe and a builder that makes the fresh model and
tokenizer, and runs AdamW (linear warmup → cosine), gradient clipping, fp32 or bf16 autocast,
per-step telemetry (``metrics.jsonl``), the gate-collapse alarm, periodic evaluation and
atomic checkpoints; with ``resume=True`` it continues from the newest checkpoint exactly as
the uninterrupted run would have.

SIGTERM / SIGINT (`rltt.runtime.stop`): the step in progress finishes within
``train.stop_grace_s`` (before its optimizer step it may be abandoned), the last completed step
is checkpointed, the metrics are flushed and the run raises `Stopped`; ``--resume`` continues
from that step. The run holds an OS lock on ``logging.run_dir`` for its lifetime
(`rltt.runtime.run_lock`): a second run on the folder is refused before it writes anything.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from rltt.config import to_dict
from rltt.data.tokenizer import load_tokenizer
from rltt.errors import RlttError
from rltt.model import LoopedForCausalLM
from rltt.runtime import checkpoint as ckpt
from rltt.runtime import guard
from rltt.lm_training.alarm import CollapseAlarm
from rltt.lm_training.corpus import Sources, eval_problems, held_out_batches, open_sources, train_packer
from rltt.lm_training.held_out import held_out_metrics, solve_metrics, solve_rate
from rltt.lm_training.losses import batch_loss
from rltt.runtime.device import pick_device, require_cuda
from rltt.runtime.paths import check_run_dir
from rltt.runtime.run_lock import RunLock
from rltt.runtime.stop import StepAbandoned, Stopped, StopSignals, commit
from rltt.sections import parsed_exit_policy
from rltt.lm_training.stage_recipe import StageRecipe
from rltt.lm_training.lr_schedule import warmup_cosine
from rltt.telemetry import (MetricsLogger, exit_stats, grad_norms, peak_memory_gb, reset_peak_memory, schema,
                            truncate_metrics)

FINAL_DIR = "final"
SUMMARY_FILE = "summary.json"
ALARMS_FILE = "alarms.jsonl"

Builder = Callable[[StageRecipe, Sources], tuple[LoopedForCausalLM, object]]


@dataclass
class StageResult:
    """What a finished (or stopped) stage run leaves behind."""

    run_dir: Path
    final_dir: Path | None
    step: int
    eval: dict = field(default_factory=dict)
    alarms: list[dict] = field(default_factory=list)
    wall_time_s: float = 0.0


def make_optimizer(model, recipe: StageRecipe) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors/scalars (norms, biases, gate bias, injection) do not."""
    o = recipe.optim
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)


def _unique_params(model):
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class StageRun:
    """One run of an LM stage: state, one optimizer step, logging, evaluation, checkpoints."""

    def __init__(self, recipe: StageRecipe, build: Builder, *, resume: bool = False, stage: str = "stage",
                 recipe_file: str | Path | None = None):
        self.recipe, self.stage = recipe, stage
        require_cuda(recipe.model.device)  # CUDA unusable here: one line, before the run folder is touched
        self.run_dir = check_run_dir(recipe.logging.run_dir, "logging.run_dir", {
            "data.source": recipe.data.source, "tokenizer.path": recipe.tokenizer.path,
            "model.dense_path": getattr(recipe.model, "dense_path", None), "the recipe file": recipe_file})
        self.lock = RunLock.acquire(self.run_dir, "logging.run_dir")  # one writer: refused before any write
        try:
            self._setup(build, resume)
        except BaseException:
            self.lock.release()
            raise

    def _setup(self, build: Builder, resume: bool) -> None:
        recipe = self.recipe
        if resume:
            ckpt.require_run(self.run_dir, "logging.run_dir")
        ckpt.clean_stale(self.run_dir, self.run_dir / ckpt.CHECKPOINTS)  # what killed writes left
        t = recipe.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = pick_device(recipe.model.device)
        self.sources = open_sources(recipe.data)
        resume_from = ckpt.latest_checkpoint(self.run_dir) if resume else None
        if not resume and (self.run_dir / "metrics.jsonl").exists():
            raise RlttError(f"logging.run_dir {self.run_dir} already holds a run; pass --resume or choose "
                            "another logging.run_dir")
        torch.manual_seed(recipe.seed)
        if resume_from is not None:
            self.model = LoopedForCausalLM.from_pretrained(resume_from, dtype=torch.float32, local_files_only=True)
            self.tokenizer = load_tokenizer(resume_from)
        else:
            self.model, self.tokenizer = build(recipe, self.sources)
        self.model.to(self.device).train()
        self.packer = train_packer(self.sources, self.tokenizer, recipe.data)
        self.optimizer = make_optimizer(self.model, recipe)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(
            warmup_cosine, total_steps=t.steps, warmup_steps=recipe.optim.warmup_steps,
            min_ratio=recipe.optim.min_lr_ratio))
        a = recipe.alarm
        self.alarm = CollapseAlarm(a.p1_threshold, a.patience, a.min_step)
        self.guard = guard.NonFiniteGuard(self.run_dir, t.max_consecutive_skips, ALARMS_FILE)
        self.step, self.tokens_seen, self.elapsed = 0, 0, 0.0
        self.saved_step = -1  # the step of the newest checkpoint written or resumed from
        if resume_from is not None:
            self._load_state(ckpt.load_trainer_state(resume_from))
            self.saved_step = self.step
        self.autocast = (partial(torch.autocast, self.device.type, dtype=torch.bfloat16)
                         if recipe.model.dtype == "bf16" else nullcontext)
        self.held_out = held_out_batches(self.sources, self.tokenizer, recipe.data, t.batch_size,
                                         recipe.eval.loss_batches) if recipe.eval.loss_batches else []
        e = recipe.eval
        self.problems = eval_problems(recipe.data, e.solve_problems) if recipe.data.is_synthetic else []
        # resuming (even from no checkpoint: step 0) drops the records of steps about to be redone
        self.logger = MetricsLogger(self.run_dir, resume_step=self.step if resume else None)
        if resume and (self.run_dir / ALARMS_FILE).exists():  # drop the alarms of steps about to be redone
            truncate_metrics(self.run_dir / ALARMS_FILE, self.step)
        self.last_eval: dict = {}

    # -- state -----------------------------------------------------------------------------
    def _state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "packer": self.packer.state_dict(), "alarm": self.alarm.state_dict(), "guard": self.guard.state_dict(),
                "tokens_seen": self.tokens_seen, "elapsed": self.elapsed, "stage": self.stage}

    def _load_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.packer.load_state_dict(state["packer"])
        self.alarm.load_state_dict(state["alarm"])
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
        self.tokens_seen, self.elapsed, self.step = state["tokens_seen"], state["elapsed"], state["step"]
        ckpt.set_rng_state(state["rng"])

    def save(self) -> Path:
        c = self.recipe.checkpoint
        path = ckpt.save_checkpoint(self.run_dir, self.step, self.model, self.tokenizer, self._state(),
                                    to_dict(self.recipe), keep_last=c.keep_last, keep_every=c.keep_every)
        self.saved_step = self.step
        return path

    def _position(self) -> dict:
        """What a step changes before its optimizer step (restored when the step is abandoned)."""
        return {"packer": self.packer.state_dict(), "rng": ckpt.rng_state(), "tokens_seen": self.tokens_seen,
                "elapsed": self.elapsed}

    def _abandoned(self, position: dict) -> None:
        """Back to the last completed step: its data position, RNG and counters; no gradients."""
        self.packer.load_state_dict(position["packer"])
        ckpt.set_rng_state(position["rng"])
        self.tokens_seen, self.elapsed = position["tokens_seen"], position["elapsed"]
        self.optimizer.zero_grad(set_to_none=True)

    def _stopped(self, stop: StopSignals) -> Stopped:
        """Checkpoint the last completed step (unless it has one), flush the metrics, say so."""
        path = None
        if self.step > 0:
            path = self.save() if self.saved_step != self.step else ckpt.checkpoint_dir(self.run_dir, self.step)
        self.logger.close()
        resume = "continue it with --resume" if self.step > 0 else "nothing to keep yet: --resume starts it afresh"
        return Stopped(f"rltt {self.stage}", stop.signame or "a signal", self.step, path, resume)

    # -- one step --------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step over ``grad_accum`` batches; returns its metrics. A non-finite loss
        or gradient skips the update (the non-finite guard; see :mod:`rltt.runtime.guard`)."""
        t, o = self.recipe.train, self.recipe.optim
        start = time.perf_counter()
        results, probs = [], []
        for _ in range(t.grad_accum):
            batch = self.packer.batch(t.batch_size)
            if batch is None:
                raise RlttError(f"data.source {self.recipe.data.source} ran out of documents")
            with self.autocast():
                loss, exit_probs = batch_loss(self.model, batch.to(self.device), self.recipe.objective.beta,
                                              self.recipe.objective.eps)
            (loss.loss / t.grad_accum).backward()
            results.append(loss)
            probs.append(exit_probs.detach().float().reshape(exit_probs.shape[0], -1))
            self.tokens_seen += batch.numel()
        commit()  # from the optimizer step on, a stop signal lets the step finish (rltt.runtime.stop)
        norms = grad_norms(self.model)
        reason = guard.check([r.loss for r in results], self.model)
        if reason is None:
            if o.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(_unique_params(self.model), o.grad_clip)
            self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self.guard.step(self.step, reason)
        seconds = time.perf_counter() - start
        self.elapsed += seconds

        n = len(results)
        metrics = {
            schema.LM_LOSS: sum(float(r.expected_loss) for r in results) / n,
            schema.LOSS_TOTAL: sum(float(r.loss.detach()) for r in results) / n,
        }
        step_losses = sum(r.step_losses for r in results) / n
        metrics.update({schema.lm_loss_step_key(i + 1): float(v) for i, v in enumerate(step_losses)})
        metrics.update(exit_stats(torch.cat(probs, dim=1)))
        metrics.update(norms)
        metrics[schema.LR] = lr
        metrics.update(self.guard.metrics())
        metrics[schema.TIME_STEP] = seconds
        metrics[schema.THROUGHPUT_TOKENS_PER_S] = t.batch_size * t.grad_accum * self.recipe.data.block_size / seconds
        return metrics

    def evaluate(self) -> dict:
        e, d = self.recipe.eval, self.recipe.data
        out = held_out_metrics(self.model, self.held_out, self.recipe.objective.beta, self.device, self.autocast)
        if self.problems:
            result = solve_rate(self.model, self.tokenizer, self.problems, template=d.prompt_template,
                                max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                                exit_policy=parsed_exit_policy(e, "exit_policy", "eval.exit_policy"),
                                batch_size=e.solve_batch_size,
                                seed=e.seed, device=self.device)
            out.update(solve_metrics(result))
        self.last_eval = out
        return out

    def _alarm(self, metrics: dict) -> None:
        alarm = self.alarm.update(self.step, metrics[schema.exit_p_key(1)])
        if alarm is not None:
            with open(self.run_dir / ALARMS_FILE, "a", encoding="utf-8") as f:
                f.write(json.dumps(self.alarm.fired[-1]) + "\n")

    # -- the loop --------------------------------------------------------------------------
    def run(self, on_step: Callable[[int, dict], None] | None = None) -> StageResult:
        try:
            self._run(on_step)
            return self.finish()
        finally:
            self.lock.release()

    def _run(self, on_step: Callable[[int, dict], None] | None) -> None:
        t = self.recipe.train
        self.bar = tqdm(total=t.steps, initial=self.step, desc=self.stage, disable=not self.recipe.logging.progress,
                        dynamic_ncols=True)
        # tiny Adam second moments and gate gradients turn denormal and slow CPU math ~10x: flush
        # them for the run only (the setting is process-wide; other code in the process keeps IEEE)
        flush = self.device.type == "cpu" and torch.set_flush_denormal(True)
        try:
            with StopSignals(t.stop_grace_s, f"rltt {self.stage}") as stop:
                while self.step < t.steps:
                    if stop.requested:  # at a step boundary
                        raise self._stopped(stop)
                    position = self._position()
                    try:
                        with stop.step():
                            self._loop_step(on_step)
                    except StepAbandoned:  # before its optimizer step: the model holds the last completed step
                        self._abandoned(position)
                        raise self._stopped(stop) from None
        finally:
            if flush:
                torch.set_flush_denormal(False)
            self.bar.close()
            self.logger.close()

    def _loop_step(self, on_step: Callable[[int, dict], None] | None) -> None:
        """One step with its logging, evaluation, alarm and checkpoint."""
        t, e, c = self.recipe.train, self.recipe.eval, self.recipe.checkpoint
        metrics = self.train_step()
        record: dict = {}
        if self.step % self.recipe.logging.every == 0 or self.step == t.steps:
            record.update(metrics)
            record[schema.MEMORY_PEAK_GB] = peak_memory_gb(self.device)
            reset_peak_memory(self.device)  # the next record's figure is its interval's peak
            self._alarm(metrics)
        if self.step % e.every == 0 or self.step == t.steps:
            record.update(self.evaluate())
        if record:
            self.logger.log(self.step, record)
        self.guard.check_stop(self.step)  # K skipped steps in a row: stop before their checkpoint
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{metrics[schema.LM_LOSS]:.3f}", p1=f"{metrics[schema.exit_p_key(1)]:.2f}",
                             Et=f"{metrics[schema.EXIT_MEAN_STEP]:.2f}")
        if (c.every and self.step % c.every == 0) or (self.step == t.steps and c.save_final):
            self.save()
        if on_step is not None:
            on_step(self.step, metrics)

    def finish(self) -> StageResult:
        """Write ``RUN_DIR/final`` (model + tokenizer + recipe) and ``summary.json``."""
        final = ckpt.atomic_dir(self.run_dir / FINAL_DIR, lambda tmp: ckpt.write_model_dir(
            tmp, self.model, self.tokenizer, to_dict(self.recipe)))
        if not self.last_eval:
            self.last_eval = self._last_logged_eval()
        alarms = sorted(self.alarm.fired + self.guard.fired, key=lambda a: a["step"])
        summary = {"stage": self.stage, "step": self.step, "tokens": self.tokens_seen,
                   "train_seconds": round(self.elapsed, 2), "eval": self.last_eval, "alarms": alarms,
                   "skipped_steps": self.guard.skipped, "final_dir": str(final)}
        (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        return StageResult(self.run_dir, final, self.step, self.last_eval, alarms, self.elapsed)

    def _last_logged_eval(self) -> dict:
        from rltt.telemetry import read_metrics

        records = [r for r in read_metrics(self.run_dir) if any(k.startswith("eval/") for k in r)]
        if not records:
            return {}
        return {k: v for k, v in records[-1].items() if k.startswith("eval/") or k == schema.SOLVE_RATE}


def run_stage(recipe: StageRecipe, build: Builder, *, resume: bool = False, stage: str = "stage",
              on_step: Callable[[int, dict], None] | None = None,
              recipe_file: str | Path | None = None) -> StageResult:
    """Run (or resume) an LM stage to ``recipe.train.steps``; see :class:`StageRun`.
    ``recipe_file``: the user's recipe, which ``logging.run_dir`` must not overwrite."""
    return StageRun(recipe, build, resume=resume, stage=stage, recipe_file=recipe_file).run(on_step)
