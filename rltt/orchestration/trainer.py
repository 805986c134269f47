"""The RL loop (the embedded default): builds the run's parts, then per step

    TrainingStep (prompts → rollouts → rewards → advantages → filter → learner.update
                  → weight sync → metrics) → evaluation → metrics log → checkpoint

Every step's rollout seeds derive from the recipe seed, the step and each prompt's global
index, so a resumed run samples exactly what the uninterrupted run would have.

The non-finite guard (`rltt.runtime.guard`): a step whose update the learner skipped (a NaN/inf
loss or gradient: no weight change, no version bump) is recorded in ``RUN_DIR/alarms.jsonl``
and the metric ``guard/skipped_steps``; after ``train.max_consecutive_skips`` in a row the run
stops with a one-line error before that step's checkpoint, so the newest checkpoint is the
last good one. The guard's count is part of the checkpoint.

Under ``torchrun`` with the DeepSpeed backend the loop is data-parallel (rltt.orchestration.
distributed): each rank samples its share of the step's prompts, the rollout metrics are
reduced across ranks, each rank evaluates its share of the held-out chunks, and rank 0 alone
writes metrics and checkpoints. The loop knows no backend: the learner gathers, shards and
saves its own state (`Learner.save` / `load` / `rollout_state_dict`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from rltt.config import to_dict
from rltt.data.prompts import recipe_prompt_renderer
from rltt.data.reasoning import thinking_budget
from rltt.data.rewards import REWARD_ERRORS_FILE, RewardRunner
from rltt.errors import RlttError
from rltt.learner import SKIP_REASON
from rltt.orchestration.components import make_engine, make_learner
from rltt.runtime.distributed import ranks_from_env
from rltt.orchestration.policy import EvalResult, evaluate, load_policy, resolve_model_path, stop_ids
from rltt.orchestration.prompt_stream import PromptStream, eval_tasks
from rltt.orchestration.train_recipe import TrainRecipe
from rltt.orchestration.step import TrainingStep
from rltt.runtime.checkpoint import (atomic_dir, checkpoint_dir, clean_stale, latest_checkpoint, load_state_file,
                                   prune_checkpoints, require_run, rng_state, set_rng_state)
from rltt.runtime.guard import NonFiniteGuard
from rltt.runtime.paths import RESOLVED_RECIPE, check_run_dir
from rltt.telemetry import MetricsLogger, truncate_metrics
from rltt.telemetry import schema as m

STATE_FILE = "rl_state.pt"
ALARMS_FILE = "alarms.jsonl"


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    initial_solve_rate: float | None
    final_solve_rate: float | None


class LocalTrainer:
    """The RL run: checks the run directory, builds the parts (`_build_parts`: the policy's
    tokenizer, engine and learner), the prompt streams and the reward runner, then runs
    `TrainingStep` per step with evaluation, logging and checkpoints. A Ray driver
    (`rltt.orchestration.ray.RayTrainer`) overrides only how the parts are built and saved."""

    def __init__(self, recipe: TrainRecipe, resume: bool = False, recipe_root: Path | None = None):
        self.recipe = r = recipe
        self.ranks = self._ranks()
        self.run_dir = check_run_dir(r.logging.run_dir, "logging.run_dir", {  # never over an input
            "data.source": r.data.source, "data.eval_source": r.data.eval_source, "model.path": r.model.path})
        if resume:
            require_run(self.run_dir, "logging.run_dir", STATE_FILE)
        if not resume and (self.run_dir / "metrics.jsonl").exists():
            raise RlttError(f"logging.run_dir: {self.run_dir} already holds a run; pass --resume to continue it "
                            f"or choose another logging.run_dir")
        if self.ranks.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            clean_stale(self.run_dir / "checkpoints")  # .tmp-*/.staged-* of killed writes
        torch.manual_seed(r.seed)
        if r.train.threads:
            torch.set_num_threads(r.train.threads)
        self.model_path = resolve_model_path(r.model.path)
        self.runner = RewardRunner.from_specs([(s.fn, s.weight, s.timeout_s) for s in r.rewards], root=recipe_root)
        self.engine = self.learner = None
        try:
            self.tokenizer, self.engine, self.learner = self._build_parts()
            encode = lambda text: self.tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
            template = recipe_prompt_renderer(r.data, self.tokenizer)  # plain or chat, as eval and curate
            self.prompts = PromptStream(r.data.source, encode, template, r.data.split, r.data.limit, r.data.seed)
            self.eval_tasks = eval_tasks(r.data.eval_source, r.data.source, encode, template,
                                         r.data.eval_split, r.data.eval_size, r.data.seed)
            self._check_prompt_lengths()
            self.training = self._training_step(TrainingStep, self.engine, self.learner, self.prompts, self.runner,
                                                self.tokenizer.decode, stop_ids(self.tokenizer),
                                                self.tokenizer.pad_token_id or 0, self.ranks,
                                                thinking_budget(r.rollout.thinking, self.tokenizer))
            self.step = 0
            self.first_eval: float | None = None
            main = self.ranks.main  # every rank counts the skips (their verdicts agree), rank 0 writes them
            self.guard = NonFiniteGuard(self.run_dir if main else None, r.train.max_consecutive_skips, ALARMS_FILE,
                                        warn=main)
            if resume:
                self._resume()
        except BaseException:
            self.close()
            raise
        self.logger = None  # rank 0's
        if self.ranks.main:
            (self.run_dir / RESOLVED_RECIPE).write_text(yaml.safe_dump(to_dict(r), sort_keys=False))
            self.runner.open_error_log(self.run_dir / REWARD_ERRORS_FILE, self.step if resume else None)
            if resume and (self.run_dir / ALARMS_FILE).exists():  # the alarms of the steps about to be redone
                truncate_metrics(self.run_dir / ALARMS_FILE, self.step)
            self.logger = MetricsLogger(self.run_dir, tensorboard=r.logging.tensorboard, wandb=r.logging.wandb,
                                        resume_step=self.step if resume else None, config=to_dict(r))

    def _check_prompt_lengths(self) -> None:
        """Every prompt plus ``rollout.max_new_tokens`` must fit the model's positions: a one-line
        error naming the source and the record before any step runs."""
        import json

        config = Path(self.model_path) / "config.json"
        try:
            positions = int(json.loads(config.read_text(encoding="utf-8"))["max_position_embeddings"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # not a local checkpoint with a plain config: the engine checks each prompt
        r = self.recipe
        limit = positions - r.rollout.max_new_tokens
        what = (f"with rollout.max_new_tokens={r.rollout.max_new_tokens} it does not fit the model's "
                f"max_position_embeddings={positions}")
        self.prompts.check_lengths(limit, f"data.source={r.data.source}", what)
        for task in self.eval_tasks:
            if len(task.prompt_ids) > limit:
                raise RlttError(f"data.eval_source={r.data.eval_source or r.data.source}: the prompt of record "
                                f"{task.id!r} has {len(task.prompt_ids)} tokens; {what}")

    # -- the parts (overridden by the Ray driver) -------------------------------------------------
    def _ranks(self):
        return ranks_from_env(self.recipe.learner.backend, self.recipe.rollout.prompts_per_step)

    def _build_parts(self):
        """(tokenizer, engine, learner) in this process: the engine takes the model before the
        learner wraps it."""
        r = self.recipe
        model, tokenizer = load_policy(self.model_path, r.model.dtype, r.model.device, r.model.convert)
        engine = make_engine(r, model)
        return tokenizer, engine, make_learner(r, model, self.ranks.world)

    def _training_step(self, cls, *args):
        return cls(self.recipe, *args)

    def close(self) -> None:
        """Release what the parts hold (reward workers; engines with a process of their own)."""
        self.runner.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def train_step(self, step: int) -> dict:
        """One RL step (`TrainingStep`): its metrics, with the guard's count; a skipped update is
        recorded by the guard (its reason is never logged as a metric)."""
        metrics = self.training(step)
        self.guard.step(step, metrics.pop(SKIP_REASON, None))
        metrics.update(self.guard.metrics())
        return metrics

    # -- evaluation, checkpoints ------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Held-out solve rate of the rollout policy. With several ranks each evaluates its share
        of the task chunks (every rank holds the same weights) and the sums are reduced: the same
        numbers as one process, in 1/world of the time. A collective: every rank calls it."""
        r = self.recipe
        part = evaluate(self.engine, self.eval_tasks, self.tokenizer, self.runner, r.train.eval_samples,
                        r.train.eval_temperature, r.rollout.max_new_tokens, seed=r.seed + 7,
                        exit_policy=r.rollout.exit_policy, schedule=r.rollout.schedule,
                        shard=(self.ranks.rank, self.ranks.world), thinking=self.training.thinking)
        result = EvalResult(**self.ranks.reduce(vars(part), EvalResult.OPS))
        return {"eval/solve_rate": result.solve_rate, "eval/reward_mean": result.reward_mean,
                "eval/exit_step_mean": result.mean_exit_step}

    def loop_state(self) -> dict:
        """The loop's part of a checkpoint (``rl_state.pt``): tensors and plain data only."""
        return {"step": self.step, "prompts": self.prompts.state_dict(), "rng": rng_state(),
                "first_eval": self.first_eval, "guard": self.guard.state_dict()}

    def save(self) -> Path:
        """Checkpoint atomically (a collective): every rank's learner writes its part into one
        staging directory, which rank 0 completes (tokenizer, recipe, loop state) and moves into place."""
        state = self.loop_state()
        final = checkpoint_dir(self.run_dir, self.step)
        staged = final.parent / f".staged-{final.name}"
        if self.ranks.main:
            shutil.rmtree(staged, ignore_errors=True)  # left by a crash
        self.ranks.barrier()
        self.learner.save(staged)  # returns once every rank has written

        def write(tmp: Path) -> None:
            os.replace(staged, tmp)
            self.tokenizer.save_pretrained(tmp)
            (tmp / "recipe.yaml").write_text(yaml.safe_dump(to_dict(self.recipe), sort_keys=False))
            torch.save(state, tmp / STATE_FILE)

        if self.ranks.main:
            atomic_dir(final, write)
            prune_checkpoints(self.run_dir, self.recipe.checkpoint.keep_last, self.recipe.checkpoint.keep_every,
                              STATE_FILE)
        self.ranks.barrier()  # the checkpoint is complete before any rank moves on
        return final

    def learner_model(self):
        """The policy the learner trains (a `LoopedForCausalLM`)."""
        return self.learner.policy

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.run_dir, STATE_FILE)
        if ckpt is None:
            return
        state = load_state_file(ckpt / STATE_FILE)  # tensors and plain data only: a file never runs code
        self.learner.load(ckpt)
        self.prompts.load_state_dict(state["prompts"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.first_eval = state.get("first_eval")
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
        self.engine.load_weights(*self.learner.rollout_state_dict())

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> RunResult:
        try:
            return self._run()
        finally:
            if self.logger is not None:
                self.logger.close()
            self.close()

    def _run(self) -> RunResult:
        from tqdm import tqdm

        r = self.recipe
        final_eval = None
        main = self.ranks.main
        if self.step == 0 and r.train.eval_every > 0:
            ev = self.evaluate()
            if main:
                self.first_eval = ev["eval/solve_rate"]
                self.logger.log(0, ev)
        bar = tqdm(range(self.step, r.train.steps), initial=self.step, total=r.train.steps, desc="rltt train",
                   disable=not (r.logging.progress and main), dynamic_ncols=True)
        for _ in bar:
            self.step += 1
            metrics = self.train_step(self.step)
            last = self.step == r.train.steps
            if r.train.eval_every > 0 and (self.step % r.train.eval_every == 0 or last):
                metrics.update(self.evaluate())
                final_eval = metrics.get("eval/solve_rate")
            if main:
                self.logger.log(self.step, metrics)
            self.guard.check_stop(self.step)  # K skipped steps in a row: stop before their checkpoint
            bar.set_postfix(reward=f"{metrics[m.REWARD_MEAN]:.2f}", kl=f"{metrics.get(m.KL_REF, 0):.1e}")
            if (r.checkpoint.every and self.step % r.checkpoint.every == 0) or (last and r.checkpoint.save_final):
                self.save()
            if r.logging.review_every and main:
                from rltt.telemetry import maybe_review

                maybe_review(self.run_dir, self.step, r.logging.review_every)
        if main:
            self.logger.close()
            if r.logging.review_at_end:
                from rltt.telemetry import maybe_review

                maybe_review(self.run_dir, self.step, 0, final=True)
        self.ranks.barrier()  # the ranks finish together, after rank 0's review
        return RunResult(self.run_dir, self.step, self.first_eval, final_eval)

