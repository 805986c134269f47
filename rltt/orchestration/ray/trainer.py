"""The Ray driver: the local loop's prompt stream, seeds, rewards, advantages, metrics and
checkpoints, with the rollout engine a `RayRolloutPool` and the learner a `RayLearnerGroup`.

The driver owns everything but the two seams, so it inherits `LocalTrainer`'s rollout phase
(prompts, dynamic sampling, reward scoring, rollout metrics), its evaluation and its loop. Only
the learner phase differs: it goes through the `Learner` interface (update, rollout_state_dict,
save, load) and, with ``orchestration.overlap: 1``, the next step's rollout phase runs while the
learner group updates (the rollouts are then one weights version old: ``orchestration/staleness``
1; the learner's ratio is against the recorded sampler log-probs).

``RUN_DIR/cluster.json`` lists every actor (role, node, pid, restarts) as the run goes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from rltt.config import to_dict
from rltt.data.rewards import RewardRunner
from rltt.errors import RlttError
from rltt.objectives import group_advantages
from rltt.orchestration.distributed import Ranks
from rltt.orchestration.groups import ScoredGroups, to_learner_batch
from rltt.orchestration.local import STATE_FILE, LocalTrainer
from rltt.orchestration.policy import resolve_model_path
from rltt.orchestration.prompts import PromptStream, eval_tasks
from rltt.orchestration.ray.adapters import LearnerFromDir, engine_dtype
from rltt.orchestration.ray.config import check_recipe
from rltt.stages.checkpoint import atomic_dir, checkpoint_dir, latest_checkpoint, rng_state, set_rng_state
from rltt.telemetry import MetricsLogger, Timer, peak_memory_gb
from rltt.telemetry import schema as m

STALENESS = "orchestration/staleness"
OVERLAP_SAVED = "orchestration/overlap_saved_s"
WORKER_RESTARTS = "orchestration/worker_restarts"
RESHARDS = "orchestration/reissued_shards"
CLUSTER_FILE = "cluster.json"


@dataclass
class _Sampled:
    """A rollout phase done ahead of its step (overlap): its groups, metrics and weights version."""

    step: int
    groups: ScoredGroups
    metrics: dict
    version: int


class RayTrainer(LocalTrainer):
    def __init__(self, recipe, resume: bool = False, recipe_root: Path | None = None):
        from transformers import AutoTokenizer

        from rltt.orchestration.ray.cluster import ClusterLog, connect
        from rltt.orchestration.ray.learner_group import RayLearnerGroup
        from rltt.orchestration.ray.rollout_pool import NativeFromDir, RayRolloutPool

        check_recipe(recipe)
        r = self.recipe = recipe
        self.ranks = Ranks()  # the driver is one process; the actors are the parallelism
        self.run_dir = Path(r.logging.run_dir)
        if not resume and (self.run_dir / "metrics.jsonl").exists():
            raise RlttError(f"logging.run_dir: {self.run_dir} already holds a run; pass --resume to continue it "
                            f"or choose another logging.run_dir")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(r.seed)
        self.model_path = resolve_model_path(r.model.path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise RlttError(f"model.path: no tokenizer in {self.model_path} ({type(exc).__name__})") from None
        self.runner = RewardRunner.from_specs([(s.fn, s.weight) for s in r.rewards], root=recipe_root)
        encode = lambda text: self.tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
        self.prompts = PromptStream(r.data.source, encode, r.data.prompt_template, r.data.split, r.data.limit,
                                    r.data.seed)
        self.eval_tasks = eval_tasks(r.data.eval_source, r.data.source, encode, r.data.prompt_template,
                                     r.data.eval_split, r.data.eval_size, r.data.seed)
        cfg = r.orchestration.ray
        self._started_ray = connect(cfg)
        self.cluster = ClusterLog(self.run_dir / CLUSTER_FILE)
        self.engine = self.learner = None
        try:
            self.learner = RayLearnerGroup(LearnerFromDir(r, str(self.model_path)), cfg, self.cluster)
            self.engine = RayRolloutPool(NativeFromDir(str(self.model_path), engine_dtype(r), r.model.device,
                                                       r.model.convert or None), cfg, self.cluster)
        except BaseException:
            self.close()
            raise
        self.overlap = bool(r.orchestration.overlap)
        self._ahead: _Sampled | None = None
        self.step = 0
        self.first_eval: float | None = None
        if resume:
            self._resume()
        self.logger = MetricsLogger(self.run_dir, tensorboard=r.logging.tensorboard, wandb=r.logging.wandb,
                                    resume_step=self.step if resume else None, config=to_dict(r))
        (self.run_dir / "recipe.yaml").write_text(yaml.safe_dump(to_dict(r), sort_keys=False))

    # -- one RL step: the local rollout phase, the learner phase through the interface ----------
    def _sample(self, step: int) -> _Sampled:
        metrics: dict = {}
        with Timer(metrics, m.TIME_ROLLOUT):
            groups = self.rollout(step, metrics)
        return _Sampled(step, groups, metrics, self.engine.weights_version)

    def train_step(self, step: int) -> dict:
        r = self.recipe
        t0 = time.perf_counter()
        sampled = self._ahead if self._ahead is not None and self._ahead.step == step else self._sample(step)
        self._ahead = None
        metrics = dict(sampled.metrics)
        groups = sampled.groups
        tokens = sum(len(c.completion_ids) for c in groups.completions)
        metrics[m.THROUGHPUT_TOKENS_PER_S] = tokens / max(metrics[m.TIME_ROLLOUT], 1e-9)
        rewards = torch.tensor(groups.rewards)
        with Timer(metrics, m.TIME_LEARNER):
            batch = to_learner_batch(groups, torch.zeros_like(rewards), r.rollout.temperature,
                                     pad_id=self.tokenizer.pad_token_id or 0)
            if r.algorithm.kl_in == "reward" and r.algorithm.kl_coef > 0:
                rewards = rewards - r.algorithm.kl_coef * self.learner.sequence_kl(batch).cpu()
            batch.advantages = group_advantages(rewards, groups.group_size, r.algorithm.advantage_scale).advantages
            metrics[STALENESS] = self.learner.version - sampled.version
            pending = self.learner.submit_update(batch)
            del batch  # the shares live in the object store only until the update returns
            if self.overlap and step < r.train.steps:
                self._ahead = self._sample(step + 1)  # while the learners update
            update, update_s = self.learner.finish_update(pending)
            metrics.update(update)
        if self._ahead is not None:
            metrics[OVERLAP_SAVED] = min(self._ahead.metrics[m.TIME_ROLLOUT], update_s)
        with Timer(metrics, m.TIME_WEIGHT_SYNC):
            self.engine.load_weights(*self.learner.rollout_state_dict())
        metrics[WORKER_RESTARTS] = self.cluster.restarts("rollout")
        metrics[RESHARDS] = self.engine.reissued
        metrics[m.TIME_STEP] = time.perf_counter() - t0
        metrics[m.MEMORY_PEAK_GB] = peak_memory_gb()
        return metrics

    # -- checkpoints ------------------------------------------------------------------------
    def save(self) -> Path:
        """The learner group writes its state (weights, optimizer) into the checkpoint; the driver
        adds the tokenizer, the recipe and the loop state (with overlap, the rollouts sampled
        ahead, so a resumed run trains on exactly what the uninterrupted one did)."""
        state = {"step": self.step, "prompts": self.prompts.state_dict(), "rng": rng_state(),
                 "first_eval": self.first_eval, "ahead": self._ahead}
        final = checkpoint_dir(self.run_dir, self.step)

        def write(tmp: Path) -> None:
            self.learner.save(tmp)
            self.tokenizer.save_pretrained(tmp)
            (tmp / "recipe.yaml").write_text(yaml.safe_dump(to_dict(self.recipe), sort_keys=False))
            torch.save(state, tmp / STATE_FILE)

        atomic_dir(final, write)
        self.learner.checkpointed(final)
        return final

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.run_dir, STATE_FILE)
        if ckpt is None:
            return
        state = torch.load(ckpt / STATE_FILE, weights_only=False)
        self.learner.load(ckpt)
        self.prompts.load_state_dict(state["prompts"])
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.first_eval = state.get("first_eval")
        self._ahead = state.get("ahead")
        self.engine.load_weights(*self.learner.rollout_state_dict())

    # -- the loop ---------------------------------------------------------------------------
    def run(self):
        try:
            return super().run()
        finally:
            self.close()

    def close(self) -> None:
        from rltt.orchestration.ray.cluster import disconnect

        for part in (self.engine, self.learner):
            if part is not None:
                part.shutdown()
        self.engine = self.learner = None
        disconnect(self._started_ray)
