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

SIGTERM / SIGINT (`rltt.runtime.stop`): the step in progress finishes within
``train.stop_grace_s`` (or, not yet committed to its update, is abandoned), the last completed
step is checkpointed, the metrics are flushed and the run raises `Stopped` (``rltt train``
exits with `EXIT_STOPPED`); ``--resume`` continues from that step. Under torchrun the ranks
agree on the stop at each step boundary (one reduction) and all stop at the same step. A run
holds an OS lock on its run directory (`rltt.runtime.run_lock`; rank 0 or the Ray driver): a
second run on the folder is refused before it writes anything.

The loop takes its parts from an orchestration (`ORCHESTRATIONS`, chosen by
``orchestration.backend``): ``local`` builds them in this process, ``ray`` on Ray actors; the
loop, its checkpoints (`CheckpointSaver`) and its evaluation (`HeldOutEvaluator`) are the same.
"""

from __future__ import annotations

import json
import sys
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
from rltt.model.model_source import ModelSource
from rltt.orchestration.parts import LOCAL, Orchestration, PartDied, RunParts
from rltt.orchestration.evaluator import HeldOutEvaluator
from rltt.orchestration.policy import resolve_model_path, stop_ids, with_chunk_rows
from rltt.orchestration.prompt_stream import PromptLimit, PromptStream, eval_tasks
from rltt.orchestration.ray.driver import RAY
from rltt.orchestration.saver import STATE_FILE, CheckpointSaver
from rltt.orchestration.train_recipe import TrainRecipe
from rltt.planning.memory_plan import plan_here
from rltt.planning.preflight import eval_cost, eval_line, plan_lines
from rltt.runtime.checkpoint import checkpoint_dir, clean_stale, require_run, rng_state, set_rng_state
from rltt.runtime.device import require_cuda
from rltt.runtime.guard import NonFiniteGuard
from rltt.runtime.paths import RESOLVED_RECIPE, check_run_dir
from rltt.runtime.run_lock import RunLock
from rltt.runtime.stop import StepAbandoned, Stopped, StopSignals, commit
from rltt.telemetry import MetricsLogger, truncate_metrics
from rltt.telemetry.metrics_file import ISOLATION_FILE
from rltt.telemetry import schema as m

ALARMS_FILE = "alarms.jsonl"

#: ``orchestration.backend`` -> where the run's parts live
ORCHESTRATIONS: dict[str, Orchestration] = {"local": LOCAL, "ray": RAY}


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    initial_solve_rate: float | None
    final_solve_rate: float | None


class Trainer:
    """The RL run: checks the run directory, takes its parts (tokenizer, engine, learner, training
    step) from its orchestration, builds the prompt streams, the reward runner, the checkpoint
    saver and the held-out evaluator, then runs the training step per step with evaluation,
    logging and checkpoints. ``orchestration``: default, the recipe's ``orchestration.backend``;
    ``restarts``: how often the run's parts were rebuilt already (`train`)."""

    def __init__(self, recipe: TrainRecipe, resume: bool = False, recipe_root: Path | None = None,
                 orchestration: Orchestration | None = None, restarts: int = 0):
        self.recipe = r = recipe
        require_cuda(r.model.device)  # a GPU recipe where CUDA is unusable: one line, before anything starts
        self.orchestration = orchestration or ORCHESTRATIONS[r.orchestration.backend]
        self.ranks = self.orchestration.ranks(r)
        self.run_dir = check_run_dir(r.logging.run_dir, "logging.run_dir", {  # never over an input
            "data.source": r.data.source, "data.eval_source": r.data.eval_source, "model.path": r.model.path})
        self.runner: RewardRunner | None = None
        self.parts: RunParts | None = None
        self.logger = None  # rank 0's
        self.saved_step = -1  # the step of the newest checkpoint this trainer wrote or resumed from
        # one writer per run directory (rank 0 / the Ray driver): a second run is refused here,
        # before it writes anything
        self.lock = RunLock.acquire(self.run_dir, "logging.run_dir") if self.ranks.main else None
        try:
            self._setup(resume, recipe_root, restarts)
        except BaseException:
            self.close()
            raise

    def _setup(self, resume: bool, recipe_root: Path | None, restarts: int) -> None:
        r = self.recipe
        if resume:
            require_run(self.run_dir, "logging.run_dir", STATE_FILE)
        if not resume and (self.run_dir / "metrics.jsonl").exists():
            raise RlttError(f"logging.run_dir: {self.run_dir} already holds a run; pass --resume to continue it "
                            f"or choose another logging.run_dir")
        self.plan = plan_here(r, self.orchestration.planned_ranks(r, self.ranks), self.ranks.local_rank)
        if not self.plan.fits:  # before anything loads: one line naming the keys to change
            raise RlttError(f"{self.plan.problem} (the whole plan: rltt plan RECIPE.yaml)")
        r = self.recipe = with_chunk_rows(r, self.plan)  # the rows a rollout runs at once, as the plan chose them
        if self.ranks.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            clean_stale(self.run_dir / "checkpoints")  # .tmp-*/.staged-* of killed writes
        torch.manual_seed(r.seed)
        if r.train.threads:
            torch.set_num_threads(r.train.threads)
        self.model_path = resolve_model_path(r.model.path)
        self.runner = RewardRunner.from_specs([(s.fn, s.weight, s.timeout_s) for s in r.rewards], root=recipe_root)
        self.parts = self.orchestration.build(r, self.model_path, self.run_dir, self.ranks, restarts)
        self.tokenizer, self.engine, self.learner = self.parts.tokenizer, self.parts.engine, self.parts.learner
        encode = lambda text: self.tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
        template = recipe_prompt_renderer(r.data, self.tokenizer)  # plain or chat, as eval and curate
        self.prompts = PromptStream(r.data.source, encode, template, r.data.split, r.data.limit, r.data.seed)
        self.eval_tasks = eval_tasks(r.data.eval_source, r.data.source, encode, template,
                                     r.data.eval_split, r.data.eval_size, r.data.seed)
        self._check_prompt_lengths()
        self._limit_prompts()
        thinking = thinking_budget(r.rollout.thinking, self.tokenizer)
        self.training = self.parts.step(r, self.engine, self.learner, self.prompts, self.runner,
                                        self.tokenizer.decode, stop_ids(self.tokenizer),
                                        self.tokenizer.pad_token_id or 0, self.ranks, thinking, encode=encode)
        self.evaluate = HeldOutEvaluator(r, self.engine, self.eval_tasks, self.tokenizer, self.runner,
                                         self.ranks, thinking, getattr(self.training, "episodes", None))
        self.saver = CheckpointSaver(self.run_dir, r, self.ranks, self.tokenizer, self.learner)
        self.step = 0
        self.first_eval: float | None = None
        main = self.ranks.main  # every rank counts the skips (their verdicts agree), rank 0 writes them
        self.guard = NonFiniteGuard(self.run_dir if main else None, r.train.max_consecutive_skips, ALARMS_FILE,
                                    warn=main)
        if resume:
            self._resume()
        if self.ranks.main:
            (self.run_dir / RESOLVED_RECIPE).write_text(yaml.safe_dump(to_dict(r), sort_keys=False))
            self._record_isolation()
            self.runner.open_error_log(self.run_dir / REWARD_ERRORS_FILE, self.step if resume else None)
            if resume and (self.run_dir / ALARMS_FILE).exists():  # the alarms of the steps about to be redone
                truncate_metrics(self.run_dir / ALARMS_FILE, self.step)
            self.logger = MetricsLogger(self.run_dir, tensorboard=r.logging.tensorboard, wandb=r.logging.wandb,
                                        resume_step=self.step if resume else None, config=to_dict(r))

    def _record_isolation(self) -> None:
        """The python tool's isolation layers (when the run's environment has the tool), in
        ``RUN_DIR/isolation.json`` and one line on stderr; `rltt review` shows them."""
        env = getattr(getattr(getattr(self, "training", None), "episodes", None), "env", None)
        layers = getattr(env, "isolation", None)
        if not isinstance(layers, dict):
            return
        (self.run_dir / ISOLATION_FILE).write_text(json.dumps(layers, indent=1) + "\n")
        print(f"rltt train: python tool isolation: {', '.join(k for k, v in layers.items() if v)}", file=sys.stderr)

    def _check_prompt_lengths(self) -> None:
        """Every prompt plus ``rollout.max_new_tokens`` must fit the model's positions: a one-line
        error naming the source and the record before any step runs."""
        source = ModelSource.local(self.model_path)
        positions = source.max_positions if source is not None else None
        if positions is None:
            return  # not a local checkpoint with a plain config: the engine checks each prompt
        r = self.recipe
        # a multi-turn episode's last turn runs on the prompt and the whole history (env.max_tokens)
        key, width = ("env.max_tokens", r.env.max_tokens) if r.env.enabled else ("rollout.max_new_tokens",
                                                                                r.rollout.max_new_tokens)
        limit = positions - width
        what = f"with {key}={width} it does not fit the model's max_position_embeddings={positions}"
        self.prompts.check_lengths(limit, f"data.source={r.data.source}", what)
        for task in self.eval_tasks:
            if len(task.prompt_ids) > limit:
                raise RlttError(f"data.eval_source={r.data.eval_source or r.data.source}: the prompt of record "
                                f"{task.id!r} has {len(task.prompt_ids)} tokens; {what}")

    def _limit_prompts(self) -> None:
        """``data.max_prompt_tokens`` (what the memory plan budgets for): longer prompts are a
        one-line error, or with ``data.drop_long_prompts`` dropped and counted."""
        r = self.recipe
        train = PromptLimit(r.data.max_prompt_tokens, r.data.drop_long_prompts, f"data.source={r.data.source}")
        held = PromptLimit(r.data.max_prompt_tokens, r.data.drop_long_prompts,
                           f"data.eval_source={r.data.eval_source or r.data.source}")
        self.prompts.limit_prompts(train)
        self.eval_tasks = [task for i, task in enumerate(self.eval_tasks) if held.keep(task, i)]
        self.dropped_prompts = train.dropped + held.dropped
        if self.dropped_prompts and self.ranks.main:
            print(f"rltt train: dropped {train.dropped} training and {held.dropped} held-out prompts longer than "
                  f"data.max_prompt_tokens={r.data.max_prompt_tokens}", file=sys.stderr)

    def close(self) -> None:
        """Release what the parts hold (reward workers; engines and learners with processes or
        actors of their own; what the orchestration started), then the run directory's lock."""
        try:
            if self.runner is not None:
                self.runner.close()
            for part in (getattr(self, "training", None), getattr(self, "evaluate", None)):
                if getattr(part, "episodes", None) is not None:  # the environment's worker processes
                    part.episodes.close()
            parts, self.parts = self.parts, None
            if parts is not None:
                parts.engine.close()
                parts.learner.close()
                parts.release()
        finally:
            if self.lock is not None:
                self.lock.release()

    def train_step(self, step: int) -> dict:
        """One RL step (`TrainingStep`): its metrics, with the guard's count; a skipped update is
        recorded by the guard (its reason is never logged as a metric)."""
        metrics = self.training(step)
        self.guard.step(step, metrics.pop(SKIP_REASON, None))
        metrics.update(self.guard.metrics())
        return metrics

    # -- checkpoints ------------------------------------------------------------------------
    def loop_state(self) -> dict:
        """The loop's part of a checkpoint (``rl_state.pt``): tensors and plain data only."""
        return {"step": self.step, "prompts": self.prompts.state_dict(), "rng": rng_state(),
                "first_eval": self.first_eval, "guard": self.guard.state_dict(), **self.training.state_dict()}

    def save(self, state: dict | None = None) -> Path:
        """Checkpoint the last completed step atomically (a collective under torchrun);
        ``state``: the loop state to keep (default: the loop's now)."""
        path = self.saver.save(self.step, self.loop_state() if state is None else state)
        self.saved_step = self.step
        return path

    def learner_model(self):
        """The policy the learner trains (a `LoopedForCausalLM`; in this process only)."""
        return self.learner.policy

    def _resume(self) -> None:
        found = self.saver.latest()
        if found is None:
            return
        ckpt, state = found
        self.saved_step = state["step"]
        self.learner.load(ckpt)
        self.prompts.load_state_dict(state["prompts"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.first_eval = state.get("first_eval")
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
        self.training.load_state_dict(state)
        self.engine.load_weights(*self.learner.rollout_state_dict())

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> RunResult:
        stopped = False
        try:
            # installed here, after the parts are built (ray.init installs a SIGTERM handler of its own)
            with StopSignals(self.recipe.train.stop_grace_s, "rltt train", abandon=self.ranks.world == 1) as stop:
                return self._run(stop)
        except Stopped:
            stopped = True
            raise
        finally:
            if self.logger is not None:
                self.logger.close()
            self.close()
            if stopped:
                self.ranks.close()  # every rank stopped at the same step: the group ends together

    def _stop_agreed(self, stop: StopSignals) -> bool:
        """Whether any rank was asked to stop (one reduction at each step boundary under torchrun)."""
        if self.ranks.world == 1:
            return stop.requested
        return bool(self.ranks.reduce({"stop": int(stop.requested)}, "max")["stop"])

    def _stopped(self, stop: StopSignals, state: dict | None = None) -> Stopped:
        """Keep the last completed step (a checkpoint, unless it has one already), flush the
        metrics, and say so. ``state``: the loop state as that step left it (after an abandoned
        step; default: now)."""
        ckpt = None
        if self.step > 0:
            if self.saved_step != self.step:
                self.save(state)
            ckpt = checkpoint_dir(self.run_dir, self.step)
        if self.logger is not None:
            self.logger.close()
        resume = "continue it with --resume" if self.step > 0 else "nothing to keep yet: --resume starts it afresh"
        return Stopped("rltt train", stop.signame or "another rank's signal", self.step, ckpt, resume)

    def _run(self, stop: StopSignals) -> RunResult:
        from tqdm import tqdm

        r = self.recipe
        final_eval = None
        main = self.ranks.main
        if main:
            self._preflight()
        if self.step == 0 and r.train.eval_every > 0:
            try:
                with stop.step():
                    ev = self.evaluate()
            except StepAbandoned:
                raise self._stopped(stop) from None
            if main:
                self.first_eval = ev["eval/solve_rate"]
                self.logger.log(0, ev)
        bar = tqdm(range(self.step, r.train.steps), initial=self.step, total=r.train.steps, desc="rltt train",
                   disable=not (r.logging.progress and main), dynamic_ncols=True)
        for _ in bar:
            if self._stop_agreed(stop):  # at a step boundary: every rank stops after the same step
                raise self._stopped(stop)
            before = self.loop_state() if stop.abandon else None  # the last completed step's loop state
            try:
                with stop.step():
                    final_eval = self._loop_step(bar, final_eval)
            except StepAbandoned:  # before its update: the learner still holds the last completed step
                self.step = before["step"]
                raise self._stopped(stop, before) from None
        if main:
            self.logger.close()
            if r.logging.review_at_end:
                from rltt.telemetry import maybe_review

                maybe_review(self.run_dir, self.step, 0, final=True)
        self.ranks.barrier()  # the ranks finish together, after rank 0's review
        return RunResult(self.run_dir, self.step, self.first_eval, final_eval)

    def _preflight(self) -> None:
        """Before step 1 (rank 0, stderr): the memory plan in brief and, when it runs, the cost of
        the held-out evaluation before step 1 (`rltt.planning.preflight`)."""
        r = self.recipe
        lines = plan_lines(self.plan)
        if self.step == 0 and r.train.eval_every > 0:
            lines.append(eval_line(eval_cost(r, len(self.eval_tasks), self.plan.loops), r.train.eval_every))
        for line in lines:
            print(f"rltt train: {line}", file=sys.stderr)

    def _loop_step(self, bar, final_eval: float | None) -> float | None:
        """One step: the training step (abandonable until its update commits it), then its
        evaluation, metrics, checkpoint and review; the newest held-out solve rate."""
        r = self.recipe
        main = self.ranks.main
        self.step += 1
        metrics = self.train_step(self.step)
        commit()  # (the training step commits at its update): evaluation, metrics and checkpoint finish
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
        return final_eval


def train(recipe: TrainRecipe, resume: bool = False, recipe_root: Path | None = None) -> tuple[RunResult, Trainer]:
    """Run a training to its end: ``(result, trainer)`` of the trainer that finished.

    When a part dies in a way its orchestration can recover from (`PartDied`: a Ray learner
    group lost a rank), a new trainer rebuilds the parts and resumes from the newest checkpoint —
    the same resume as ``--resume``, so the steps after that checkpoint are redone exactly as they
    were and ``metrics.jsonl`` ends as the uninterrupted run's — up to the orchestration's limit
    (``orchestration.ray.learner_restarts``)."""
    orchestration = ORCHESTRATIONS[recipe.orchestration.backend]
    restarts, limit = 0, orchestration.restarts(recipe)
    while True:
        trainer = Trainer(recipe, resume=resume, recipe_root=recipe_root, orchestration=orchestration,
                          restarts=restarts)
        try:
            return trainer.run(), trainer
        except PartDied as died:
            if restarts >= limit:
                raise
            restarts += 1
            start = died.checkpoint if died.checkpoint is not None else "the start of the run"
            print(f"WARNING: {died}; rebuilding {orchestration.rebuilds} from {start} "
                  f"({orchestration.restarts_key}: {restarts} of {limit})", file=sys.stderr)
            resume = (trainer.run_dir / "metrics.jsonl").exists()  # nothing logged yet: start afresh
