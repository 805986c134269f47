"""The Ray driver's training step: `TrainingStep` that reports its rollouts' staleness and, with
``orchestration.max_staleness: K`` ≥ 1 (``overlap: 1`` is K = 1), samples ahead while the learner
group updates — a deterministic pipeline.

The rows of step n are sampled with the weights the learner had at the start of step
max(1, n − K) — version max(0, n − 1 − K) when no update was skipped — whatever the timing: during
step n's update the rollout workers serve the weights of step n's start and sample step n + K (and,
during step 1's update, steps 2 … 1 + K, all at version 0). A step's staleness, the learner's
version minus the rows' version, is therefore min(n − 1, K) (``orchestration/staleness``; every
token of a step has the same version, so ``orchestration/staleness_mean`` is the same number). The
learner's ratio is against the recorded sampler log-probs. The up to K steps of rows sampled ahead
are part of the checkpoint (`OverlappedStep.state_dict`), so a resumed run trains on exactly what
the uninterrupted one did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from rltt.learner import LearnerBatch
from rltt.orchestration.groups import ScoredGroups
from rltt.orchestration.step import TrainingStep
from rltt.telemetry import schema as m

STALENESS = m.ORCH_STALENESS
STALENESS_MEAN = m.ORCH_STALENESS_MEAN
OVERLAP_SAVED = m.ORCH_OVERLAP_SAVED_S
WORKER_RESTARTS = m.ORCH_WORKER_RESTARTS
RESHARDS = m.ORCH_REISSUED_SHARDS
LEARNER_IDLE = m.ORCH_LEARNER_IDLE_FRAC
ROLLOUT_IDLE = m.ORCH_ROLLOUT_IDLE_FRAC


def idle_fraction(busy_s: float, window_s: float) -> float:
    """The share of ``window_s`` (a step's wall time) not covered by ``busy_s`` seconds of work."""
    return 1.0 - min(1.0, busy_s / window_s) if window_s > 0 else 0.0


@dataclass
class Sampled:
    """One step's rollout phase: its groups, metrics, the weights version it sampled with, seconds."""

    step: int
    groups: ScoredGroups
    metrics: dict
    version: int
    seconds: float


class OverlappedStep(TrainingStep):
    """`TrainingStep` that reports the rollouts' staleness and, with ``max_staleness`` K ≥ 1,
    samples steps up to n + K while step n's update runs on the learner group (its
    ``during_update`` hook)."""

    def __init__(self, *args, max_staleness: int = 0, last_step: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_staleness = int(max_staleness)
        self.last_step = last_step
        self.ahead: list[Sampled] = []  # the steps sampled ahead, in step order
        self._used: Sampled | None = None
        self._step = 0
        self._fresh: list[Sampled] = []  # those sampled during this step's update
        self._gen_s = 0.0  # seconds of this step spent sampling (a rollout in flight on the workers)
        if self.max_staleness:
            self.learner.during_update = self._sample_ahead

    def _sampled(self, step: int) -> Sampled:
        t0 = time.perf_counter()
        version = self.engine.weights_version
        groups, metrics = super().rollout(step)
        seconds = time.perf_counter() - t0
        self._gen_s += seconds
        return Sampled(step, groups, metrics, version, seconds)

    def _sample_ahead(self) -> None:
        """During step n's update the workers serve the weights of step n's start: sample every
        step up to n + K not sampled yet (n + K alone once the pipeline is full)."""
        newest = self.ahead[-1].step if self.ahead else self._step
        for step in range(newest + 1, min(self._step + self.max_staleness, self.last_step) + 1):
            sampled = self._sampled(step)
            self.ahead.append(sampled)
            self._fresh.append(sampled)

    def rollout(self, step: int):
        if self.ahead and self.ahead[0].step == step:
            self._used = self.ahead.pop(0)
        else:
            self._used = self._sampled(step)
        metrics = dict(self._used.metrics)
        metrics[STALENESS] = metrics[STALENESS_MEAN] = self.learner.version - self._used.version
        return self._used.groups, metrics

    def __call__(self, step: int) -> dict[str, float]:
        self._step, self._fresh, self._gen_s = step, [], 0.0
        metrics = super().__call__(step)
        window = metrics[m.TIME_STEP]
        metrics[LEARNER_IDLE] = idle_fraction(self.learner.last_update_s, window)
        metrics[ROLLOUT_IDLE] = idle_fraction(self._gen_s, window)
        used = self._used
        if metrics[m.TIME_ROLLOUT] < used.seconds:  # sampled ahead: its own time, not the wait for it
            metrics[m.TIME_ROLLOUT] = used.seconds
            metrics[m.THROUGHPUT_TOKENS_PER_S] = int(used.groups.batch.target_mask.sum()) / max(used.seconds, 1e-9)
        if self._fresh:
            metrics[OVERLAP_SAVED] = min(sum(s.seconds for s in self._fresh), self.learner.last_update_s)
        metrics[WORKER_RESTARTS] = self.engine.log.restarts("rollout")
        metrics[RESHARDS] = self.engine.reissued
        return metrics

    def state_dict(self) -> dict:
        """The rollouts sampled ahead (tensors and plain data), so a resumed run trains on exactly
        what the uninterrupted one did."""
        return {"ahead": [_plain(s) for s in self.ahead]}

    def load_state_dict(self, state: dict) -> None:
        ahead = state.get("ahead")
        if ahead is None or isinstance(ahead, dict):  # a checkpoint of overlap 1: one step or none
            ahead = [] if ahead is None else [ahead]
        self.ahead = [_sampled(s) for s in ahead]


def _plain(sampled: Sampled) -> dict:
    """A `Sampled` as tensors and plain data, for a checkpoint read with ``weights_only=True``."""
    g = sampled.groups
    batch = {f.name: getattr(g.batch, f.name) for f in fields(g.batch)}
    return {"step": sampled.step, "metrics": dict(sampled.metrics), "version": sampled.version,
            "seconds": sampled.seconds,
            "groups": {"batch": batch, "rewards": g.rewards, "uniform": g.uniform, "group_size": g.group_size,
                       "task_ids": list(g.task_ids), "prompt_seeds": list(g.prompt_seeds)}}


def _sampled(plain: dict) -> Sampled:
    g = dict(plain["groups"])
    groups = ScoredGroups(LearnerBatch(**g.pop("batch")), **g)
    return Sampled(plain["step"], groups, plain["metrics"], plain["version"], plain["seconds"])
