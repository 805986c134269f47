"""The Ray driver's training step: `TrainingStep` that reports its rollouts' staleness and, with
``orchestration.overlap: 1``, samples step k+1 while step k's update runs on the learner group.

A step then trains on rollouts one weights version old (``orchestration/staleness`` 1; the
learner's ratio is against the recorded sampler log-probs); the rollouts sampled ahead are part
of the checkpoint (`OverlappedStep.state_dict`), so a resumed run trains on exactly what the
uninterrupted one did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from rltt.learner import LearnerBatch
from rltt.orchestration.groups import ScoredGroups
from rltt.orchestration.step import TrainingStep
from rltt.telemetry import schema as m

STALENESS = m.ORCH_STALENESS
OVERLAP_SAVED = m.ORCH_OVERLAP_SAVED_S
WORKER_RESTARTS = m.ORCH_WORKER_RESTARTS
RESHARDS = m.ORCH_REISSUED_SHARDS


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

    def state_dict(self) -> dict:
        """The rollouts sampled ahead (tensors and plain data), so a resumed run trains on exactly
        what the uninterrupted one did."""
        return {"ahead": _plain(self.ahead)}

    def load_state_dict(self, state: dict) -> None:
        self.ahead = _sampled(state.get("ahead"))


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
