"""The single-process RL loop (the embedded default), SPEC §7:

    prompts → rollouts → rewards → advantages → (dynamic filter) → μ learner updates
            → weight sync → metrics → checkpoint

Every step's rollout seed is derived from the recipe seed and the step, so a resumed run
samples exactly what the uninterrupted run would have.

Under ``torchrun`` with the DeepSpeed backend the loop is data-parallel (rltt.orchestration.
distributed): each rank samples its share of the step's prompts with its own seed, the rollout
metrics are merged across ranks, each rank evaluates its share of the held-out chunks, and rank
0 alone writes metrics and checkpoints.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from rltt.config import to_dict
from rltt.data.rewards import REWARD_ERRORS_FILE, RewardRunner, reward_error_metrics
from rltt.errors import RlttError
from rltt.learner import Learner, frozen_copy
from rltt.objectives import group_advantages, select_informative_groups
from rltt.orchestration.distributed import RolloutTally, ranks_from_env
from rltt.orchestration.groups import ScoredGroups, score_rollout, solved, to_learner_batch
from rltt.orchestration.policy import EvalResult, evaluate, load_policy, resolve_model_path, stop_ids
from rltt.orchestration.prompts import PromptStream, eval_tasks
from rltt.orchestration.recipe import TrainRecipe
from rltt.rollout import NativeEngine, SamplingParams
from rltt.stages.checkpoint import atomic_dir, checkpoint_dir, latest_checkpoint, rng_state, set_rng_state, write_model_dir
from rltt.stages.checkpoint import clean_stale, load_state_file, prune_checkpoints, require_run  # hardening
from rltt.stages.paths import RESOLVED_RECIPE, check_run_dir  # hardening
from rltt.telemetry import MetricsLogger, Timer, peak_memory_gb
from rltt.telemetry import schema as m

STATE_FILE = "rl_state.pt"


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    initial_solve_rate: float | None
    final_solve_rate: float | None


class LocalTrainer:
    def __init__(self, recipe: TrainRecipe, resume: bool = False, recipe_root: Path | None = None):
        self.recipe = recipe
        self.ranks = ranks_from_env(recipe.learner.backend, recipe.rollout.prompts_per_step)
        self.run_dir = check_run_dir(recipe.logging.run_dir, "logging.run_dir", {  # hardening: never over an input
            "data.source": recipe.data.source, "data.eval_source": recipe.data.eval_source, "model.path": recipe.model.path})
        if resume:  # hardening
            require_run(self.run_dir, "logging.run_dir", STATE_FILE)
        if not resume and (self.run_dir / "metrics.jsonl").exists():
            raise RlttError(f"logging.run_dir: {self.run_dir} already holds a run; pass --resume to continue it "
                            f"or choose another logging.run_dir")
        if self.ranks.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            clean_stale(self.run_dir / "checkpoints")  # hardening: .tmp-*/.staged-* of killed writes
        torch.manual_seed(recipe.seed)
        if recipe.train.threads:
            torch.set_num_threads(recipe.train.threads)
        r = recipe
        self.model_path = resolve_model_path(r.model.path)
        self.model, self.tokenizer = load_policy(self.model_path, r.model.dtype, r.model.device, r.model.convert)
        self.reference = frozen_copy(self.model) if (r.algorithm.kl_coef > 0 or r.algorithm.track_kl) else None
        self.runner = RewardRunner.from_specs([(s.fn, s.weight, s.timeout_s) for s in r.rewards], root=recipe_root)
        encode = lambda text: self.tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
        self.prompts = PromptStream(r.data.source, encode, r.data.prompt_template, r.data.split, r.data.limit,
                                    r.data.seed)
        self.eval_tasks = eval_tasks(r.data.eval_source, r.data.source, encode, r.data.prompt_template,
                                     r.data.eval_split, r.data.eval_size, r.data.seed)
        # the torch backend trains the model in place, so the engine can share it (sync is free);
        # other backends hand weights over to a separate rollout copy, taken before DeepSpeed wraps
        # (and under ZeRO-3 partitions) the learner's model
        shared = r.learner.backend == "torch" and r.learner.dtype == r.model.dtype
        rollout_copy = None if shared else copy.deepcopy(self.model).eval()
        self.learner = Learner(self.model, r.learner, r.algorithm, batch_size=r.batch_size // self.ranks.world,
                               max_len=r.rollout.max_new_tokens, ref_model=self.reference)
        self.engine_model = self.model if shared else rollout_copy.to(next(self.learner.model.parameters()).dtype)
        self.engine = NativeEngine(self.engine_model)
        self.step = 0
        self.first_eval: float | None = None
        if resume:
            self._resume()
        self.logger = None  # rank 0's
        if self.ranks.main:
            (self.run_dir / RESOLVED_RECIPE).write_text(yaml.safe_dump(to_dict(recipe), sort_keys=False))
            self.runner.open_error_log(self.run_dir / REWARD_ERRORS_FILE, self.step if resume else None)  # hardening
            self.logger = MetricsLogger(self.run_dir, tensorboard=r.logging.tensorboard, wandb=r.logging.wandb,
                                        resume_step=self.step if resume else None, config=to_dict(recipe))

    # -- one RL step --------------------------------------------------------------------------
    def sampling(self, step: int, attempt: int = 0) -> SamplingParams:
        ro = self.recipe.rollout
        return SamplingParams(
            temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, max_new_tokens=ro.max_new_tokens,
            stop_token_ids=stop_ids(self.tokenizer), stop_strings=list(ro.stop_strings),
            decoder=self.tokenizer.decode if ro.stop_strings else None,
            seed=self.ranks.seed(self.recipe.seed * 1_000_003 + step * 101 + attempt), n=ro.group_size,
            exit_policy=ro.exit_policy, schedule=ro.schedule)

    def rollout(self, step: int, metrics: dict) -> ScoredGroups:
        """Sample this rank's share of prompts_per_step groups; with dynamic sampling, refill dropped
        uniform groups. Every rank draws the same prompts from the stream and keeps its share."""
        r = self.recipe
        want = r.rollout.prompts_per_step // self.ranks.world
        tasks = self.ranks.share(self.prompts.next(r.rollout.prompts_per_step))
        batch = self.engine.generate([t.prompt_ids for t in tasks], self.sampling(step))
        groups = score_rollout(batch, tasks, self.tokenizer.decode, self.runner)
        self._rollout_metrics(groups, [batch], metrics)
        if not r.algorithm.dynamic_sampling:
            return groups
        keep = ScoredGroups(group_size=groups.group_size)
        refills = 0
        for attempt in range(1, r.algorithm.max_refills + 2):
            informative = select_informative_groups(torch.tensor(groups.rewards), groups.group_size).tolist()
            keep.extend(groups.select_groups(informative))
            short = self.ranks.gather(max(want - keep.num_groups, 0))  # every rank's shortfall
            if not sum(short) or attempt > r.algorithm.max_refills:
                break
            refills += 1  # all ranks draw every rank's refill prompts, so their streams stay equal
            tasks = self.ranks.segment(self.prompts.next(sum(short)), short)
            if tasks:
                batch = self.engine.generate([t.prompt_ids for t in tasks], self.sampling(step, attempt))
                groups = score_rollout(batch, tasks, self.tokenizer.decode, self.runner)
            else:
                groups = ScoredGroups(group_size=groups.group_size)
        if keep.num_groups < want:  # still short: top up with uniform groups (zero advantage)
            informative = set(select_informative_groups(torch.tensor(groups.rewards), groups.group_size).tolist())
            filler = [g for g in range(groups.num_groups) if g not in informative][: want - keep.num_groups]
            keep.extend(groups.select_groups(filler))
        metrics["rollout/refills"] = refills
        return keep.select_groups(list(range(want)))

    def _rollout_metrics(self, groups: ScoredGroups, rollouts, metrics: dict) -> None:
        """Metrics of the step's first rollout, over all ranks' groups."""
        t = RolloutTally.merge(self.ranks.gather(RolloutTally.of(groups, rollouts[0].stats)))
        rewards = torch.tensor(t.rewards)
        adv = group_advantages(rewards, t.group_size)
        lengths = torch.tensor(t.lengths, dtype=torch.float)
        metrics.update({
            m.REWARD_MEAN: float(rewards.mean()),
            m.REWARD_STD: float(rewards.std()) if rewards.numel() > 1 else 0.0,
            m.REWARD_ERRORS: t.errors,
            m.SOLVE_RATE: sum(solved(ScoredGroups(per_fn=t.per_fn), self.runner.names[0])) / len(t.rewards),
            m.GROUPS_UNIFORM_FRAC: adv.uniform_fraction,
            m.LENGTH_MEAN: float(lengths.mean()),
            m.LENGTH_MAX: float(lengths.max()),
            m.LENGTH_TRUNC_FRAC: t.truncated / len(lengths),
            "rollout/exit_step_mean": t.exit_steps / max(float(lengths.sum()), 1),
            "rollout/passes_per_token": t.passes_per_token,
            "rollout/sequences": len(t.rewards),
        })
        for name, values in t.per_fn.items():
            metrics[m.reward_key(name)] = sum(values) / len(values)
        all_errors = [e for part in self.ranks.gather(groups.errors) for e in part]  # hardening: per-fn counts
        metrics.update(reward_error_metrics(all_errors, self.runner.names))

    def train_step(self, step: int) -> dict:
        r = self.recipe
        metrics: dict = {}
        self.runner.step = step  # hardening: recorded with reward errors
        t0 = time.perf_counter()
        with Timer(metrics, m.TIME_ROLLOUT):
            groups = self.rollout(step, metrics)
        tokens = sum(len(c.completion_ids) for c in groups.completions)
        work = self.ranks.gather((tokens, metrics[m.TIME_ROLLOUT]))  # ranks sample concurrently
        metrics[m.THROUGHPUT_TOKENS_PER_S] = sum(n for n, _ in work) / max(max(t for _, t in work), 1e-9)
        rewards = torch.tensor(groups.rewards)
        with Timer(metrics, m.TIME_LEARNER):
            batch = to_learner_batch(groups, torch.zeros_like(rewards), r.rollout.temperature,
                                     pad_id=self.tokenizer.pad_token_id or 0)
            if r.algorithm.kl_in == "reward" and r.algorithm.kl_coef > 0:
                seq_kl = self.learner.sequence_kl(batch).cpu()
                rewards = rewards - r.algorithm.kl_coef * seq_kl
            batch.advantages = group_advantages(rewards, groups.group_size, r.algorithm.advantage_scale).advantages
            metrics.update(self.learner.train_step(batch))
        with Timer(metrics, m.TIME_WEIGHT_SYNC):
            if self.engine_model is not self.learner.model:
                self.engine.load_weights(self.learner.state_dict_for_rollout())
        metrics[m.TIME_STEP] = time.perf_counter() - t0
        metrics[m.MEMORY_PEAK_GB] = max(self.ranks.gather(peak_memory_gb()))
        return metrics

    # -- evaluation, checkpoints ------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Held-out solve rate of the rollout policy. With several ranks each evaluates its share
        of the task chunks (every rank holds the same weights) and the sums are merged: the same
        numbers as one process, in 1/world of the time. A collective: every rank calls it."""
        r = self.recipe
        part = evaluate(self.engine, self.eval_tasks, self.tokenizer, self.runner, r.train.eval_samples,
                        r.train.eval_temperature, r.rollout.max_new_tokens, seed=r.seed + 7,
                        exit_policy=r.rollout.exit_policy, schedule=r.rollout.schedule,
                        shard=(self.ranks.rank, self.ranks.world))
        result = EvalResult.merge(self.ranks.gather(part))
        return {"eval/solve_rate": result.solve_rate, "eval/reward_mean": result.reward_mean,
                "eval/exit_step_mean": result.mean_exit_step}

    def save(self) -> Path:
        """Checkpoint atomically. With several ranks each writes its DeepSpeed shard (a collective
        call) into a staging directory that rank 0 moves into the checkpoint it writes."""
        state = {"step": self.step, "prompts": self.prompts.state_dict(), "rng": rng_state(),
                 "first_eval": self.first_eval}
        final = checkpoint_dir(self.run_dir, self.step)
        staged = final.parent / f".staged-{final.name}"
        # ZeRO-3 partitions the parameters: gather the full weights (a collective) for the model files
        weights = self.learner.state_dict_for_rollout() if self._zero3 else None
        if self.ranks.world > 1:
            if self.ranks.main:
                shutil.rmtree(staged, ignore_errors=True)  # left by a crash; DeepSpeed creates it anew
            self.learner.backend.save(staged)  # returns once every rank has written

        def write(tmp: Path) -> None:
            write_model_dir(tmp, self.learner_model(), self.tokenizer, to_dict(self.recipe), state_dict=weights)
            if self.ranks.world > 1:
                for item in staged.iterdir():
                    os.replace(item, tmp / item.name)
                staged.rmdir()
            else:
                self.learner.backend.save(tmp)
            torch.save(state, tmp / STATE_FILE)

        if self.ranks.main:
            atomic_dir(final, write)
            prune_checkpoints(self.run_dir, self.recipe.checkpoint.keep_last, self.recipe.checkpoint.keep_every,
                              STATE_FILE)  # hardening
        self.ranks.barrier()  # the checkpoint is complete before any rank moves on
        return final

    @property
    def _zero3(self) -> bool:
        return self.recipe.learner.backend == "deepspeed" and self.recipe.learner.zero_stage == 3

    def learner_model(self):
        from rltt.learner import unwrap

        return unwrap(self.learner.model)

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.run_dir, STATE_FILE)
        if ckpt is None:
            return
        state = load_state_file(ckpt / STATE_FILE)  # hardening: weights_only, refuses code
        from safetensors.torch import load_file

        weights = {}
        for f in sorted(ckpt.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        if not self._zero3:  # ZeRO-3's partitioned parameters come back from its own checkpoint
            self.learner_model().load_state_dict(weights, strict=False)
        self.learner.backend.load(ckpt)
        self.prompts.load_state_dict(state["prompts"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.first_eval = state.get("first_eval")
        if self.engine_model is not self.learner.model:
            self.engine.load_weights(self.learner.state_dict_for_rollout())

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> RunResult:
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
            bar.set_postfix(reward=f"{metrics[m.REWARD_MEAN]:.2f}", kl=f"{metrics.get(m.KL_REF, 0):.1e}")
            if (r.checkpoint.every and self.step % r.checkpoint.every == 0) or (last and r.checkpoint.save_final):
                self.save()
            if r.logging.review_every and main:
                from rltt.telemetry import maybe_review

                maybe_review(self.run_dir, self.step, r.logging.review_every)
        self.runner.close()  # hardening: stop the reward workers
        if main:
            self.logger.close()
            if r.logging.review_at_end:
                from rltt.telemetry import maybe_review

                maybe_review(self.run_dir, self.step, 0, final=True)
        self.ranks.barrier()  # the ranks finish together, after rank 0's review
        return RunResult(self.run_dir, self.step, self.first_eval, final_eval)

