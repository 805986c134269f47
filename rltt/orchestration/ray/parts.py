"""The Ray driver: the local loop (`LocalTrainer`) with its engine a `RayRolloutPool` and its
learner a `RayLearnerGroup`, running the very same `TrainingStep`.

The driver owns the prompt stream, seeds, rewards, advantages, metrics, evaluation and
checkpoints; the actors own the weights. With ``orchestration.overlap: 1`` (`OverlappedStep`)
the next step's rollout phase runs while the learner group updates, so a step trains on
rollouts one weights version old (``orchestration/staleness`` 1; the learner's ratio is
against the recorded sampler log-probs); the rollouts sampled ahead are part of the
checkpoint, so a resumed run trains on exactly what the uninterrupted one did.

``RUN_DIR/cluster.json`` lists every actor (role, node, pid, restarts) as the run goes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import yaml

from rltt.config import to_dict
from rltt.errors import RlttError
from rltt.runtime.distributed import Ranks
from rltt.orchestration.groups import ScoredGroups
from rltt.orchestration.trainer import STATE_FILE, LocalTrainer
from rltt.orchestration.ray.builders import EngineFromDir, LearnerFromDir
from rltt.orchestration.ray.orchestration_section import check_recipe
from rltt.orchestration.step import TrainingStep
from rltt.learner import LearnerBatch
from rltt.runtime.checkpoint import atomic_dir, checkpoint_dir, latest_checkpoint, load_state_file, prune_checkpoints
from rltt.telemetry import schema as m

STALENESS = m.ORCH_STALENESS
OVERLAP_SAVED = m.ORCH_OVERLAP_SAVED_S
WORKER_RESTARTS = m.ORCH_WORKER_RESTARTS
RESHARDS = m.ORCH_REISSUED_SHARDS
CLUSTER_FILE = "cluster.json"


@dataclass
class Sampled:
    """One step's rollout phase: its groups, metrics, the weights version it sampled with, seconds."""

    step: int
    groups: ScoredGroups
    metrics: dict
    version: int
    seconds: float


class OverlappedStep(TrainingStep):
    """`TrainingStep` that reports the rollouts' staleness and, with ``overlap``, samples step
    k+1 while step k's update runs on the learner group (its ``during_update`` hook)."""

    def __init__(self, *args, overlap: bool = False, last_step: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.overlap, self.last_step = overlap, last_step
        self.ahead: Sampled | None = None
        self._used: Sampled | None = None
        self._step = 0
        if overlap:
            self.learner.during_update = self._sample_ahead

    def _sampled(self, step: int) -> Sampled:
        t0 = time.perf_counter()
        version = self.engine.weights_version
        groups, metrics = super().rollout(step)
        return Sampled(step, groups, metrics, version, time.perf_counter() - t0)

    def _sample_ahead(self) -> None:
        if self._step < self.last_step:
            self.ahead = self._sampled(self._step + 1)

    def rollout(self, step: int):
        if self.ahead is not None and self.ahead.step == step:
            self._used, self.ahead = self.ahead, None
        else:
            self._used = self._sampled(step)
        metrics = dict(self._used.metrics)
        metrics[STALENESS] = self.learner.version - self._used.version
        return self._used.groups, metrics

    def __call__(self, step: int) -> dict[str, float]:
        self._step = step
        metrics = super().__call__(step)
        used = self._used
        if metrics[m.TIME_ROLLOUT] < used.seconds:  # sampled ahead: its own time, not the wait for it
            metrics[m.TIME_ROLLOUT] = used.seconds
            metrics[m.THROUGHPUT_TOKENS_PER_S] = int(used.groups.batch.target_mask.sum()) / max(used.seconds, 1e-9)
        if self.ahead is not None:
            metrics[OVERLAP_SAVED] = min(self.ahead.seconds, self.learner.last_update_s)
        metrics[WORKER_RESTARTS] = self.engine.log.restarts("rollout")
        metrics[RESHARDS] = self.engine.reissued
        return metrics


def _plain(sampled: Sampled | None) -> dict | None:
    """A `Sampled` as tensors and plain data, for a checkpoint read with ``weights_only=True``."""
    if sampled is None:
        return None
    g = sampled.groups
    batch = {f.name: getattr(g.batch, f.name) for f in fields(g.batch)}
    return {"step": sampled.step, "metrics": dict(sampled.metrics), "version": sampled.version,
            "seconds": sampled.seconds,
            "groups": {"batch": batch, "rewards": g.rewards, "uniform": g.uniform, "group_size": g.group_size,
                       "task_ids": list(g.task_ids), "prompt_seeds": list(g.prompt_seeds)}}


def _sampled(plain: dict | None) -> Sampled | None:
    if plain is None:
        return None
    g = dict(plain["groups"])
    groups = ScoredGroups(LearnerBatch(**g.pop("batch")), **g)
    return Sampled(plain["step"], groups, plain["metrics"], plain["version"], plain["seconds"])


class RayTrainer(LocalTrainer):
    """The RL run with its engine and learner on Ray actors: a `RayRolloutPool` and a
    `RayLearnerGroup` behind the same interfaces, driven by the same `TrainingStep` (with
    ``orchestration.overlap`` its `OverlappedStep`). Only how the parts are built, saved and
    released differs from `LocalTrainer`."""

    def __init__(self, recipe, resume: bool = False, recipe_root: Path | None = None,
                 learner_group_restarts: int = 0):
        try:
            import ray  # noqa: F401
        except ImportError:
            raise RlttError("orchestration.backend: 'ray' needs ray (pip install 'rltt[ray]')") from None
        check_recipe(recipe)
        self._started_ray = False
        self._group_restarts = learner_group_restarts
        super().__init__(recipe, resume, recipe_root)

    def _ranks(self) -> Ranks:
        return Ranks()  # one driver process; the actors are the parallelism

    def _build_parts(self):
        from transformers import AutoTokenizer

        from rltt.orchestration.ray.cluster import ClusterLog, connect
        from rltt.orchestration.ray.learner_group import RayLearnerGroup
        from rltt.orchestration.ray.rollout_pool import RayRolloutPool

        r = self.recipe
        try:  # the driver needs the tokenizer only; the model lives in the actors
            tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise RlttError(f"model.path: no tokenizer in {self.model_path} ({type(exc).__name__})") from None
        cfg = r.orchestration.ray
        self._started_ray = connect(cfg)
        self.cluster = ClusterLog(self.run_dir / CLUSTER_FILE, self._group_restarts)
        self.learner = RayLearnerGroup(LearnerFromDir(r, str(self.model_path)), cfg, self.cluster)
        self.engine = RayRolloutPool(EngineFromDir(r, str(self.model_path)), cfg, self.cluster)
        return tokenizer, self.engine, self.learner

    def _training_step(self, cls, *args):
        r = self.recipe
        return OverlappedStep(r, *args, overlap=bool(r.orchestration.overlap), last_step=r.train.steps)

    # -- checkpoints ------------------------------------------------------------------------
    def save(self) -> Path:
        """The learner group writes its state (weights, optimizer, version) into the checkpoint;
        the driver adds the tokenizer, the recipe and the loop state, with overlap the rollouts
        sampled ahead."""
        state = {**self.loop_state(), "ahead": _plain(self.training.ahead)}
        final = checkpoint_dir(self.run_dir, self.step)

        def write(tmp: Path) -> None:
            self.learner.save(tmp)
            self.tokenizer.save_pretrained(tmp)
            (tmp / "recipe.yaml").write_text(yaml.safe_dump(to_dict(self.recipe), sort_keys=False))
            torch.save(state, tmp / STATE_FILE)

        atomic_dir(final, write)
        prune_checkpoints(self.run_dir, self.recipe.checkpoint.keep_last, self.recipe.checkpoint.keep_every,
                          STATE_FILE)
        self.learner.checkpointed(final)
        return final

    def _resume(self) -> None:
        super()._resume()  # learner group, prompt stream, rng, step; the pool takes the weights
        ckpt = latest_checkpoint(self.run_dir, STATE_FILE)
        if ckpt is not None:
            self.training.ahead = _sampled(load_state_file(ckpt / STATE_FILE).get("ahead"))

    def close(self) -> None:
        from rltt.orchestration.ray.cluster import disconnect

        self.runner.close()
        for part in (self.engine, self.learner):
            if part is not None:
                part.shutdown()
        self.engine = self.learner = None
        disconnect(self._started_ray)
        self._started_ray = False


def train_with_restarts(recipe, resume: bool = False, recipe_root: Path | None = None):
    """Run a Ray training to its end, rebuilding the learner group after a learner died.

    A learner's death (`LearnerGroupDied`) ends the trainer; up to
    ``orchestration.ray.learner_restarts`` times a new one resumes the run from its newest
    checkpoint — the same resume as ``--resume``, so the steps after that checkpoint are redone
    exactly as they were and ``metrics.jsonl`` ends as the uninterrupted run's. Returns
    ``(result, trainer)`` of the trainer that finished."""
    import sys

    from rltt.orchestration.ray.learner_group import LearnerGroupDied

    restarts, limit = 0, recipe.orchestration.ray.learner_restarts
    while True:
        trainer = RayTrainer(recipe, resume=resume, recipe_root=recipe_root, learner_group_restarts=restarts)
        try:
            return trainer.run(), trainer
        except LearnerGroupDied as died:
            if restarts >= limit:
                raise
            restarts += 1
            start = died.checkpoint if died.checkpoint is not None else "the start of the run"
            print(f"WARNING: {died}; rebuilding the learner group from {start} "
                  f"(orchestration.ray.learner_restarts: {restarts} of {limit})", file=sys.stderr)
            resume = (trainer.run_dir / "metrics.jsonl").exists()  # nothing logged yet: start afresh
