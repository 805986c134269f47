"""`RayRolloutPool`: a `RolloutEngine` whose `generate` runs on N rollout-worker actors.

Each worker wraps an engine built in its own process from the model directory (the same
builder a local run uses). A call's prompts are split into contiguous shards, each with its
prompts' seeds, one shard per worker, and the shards' batches are merged back in prompt order:
rows are a pure function of (weights version, prompt, prompt seed, sample index), so the result
is bitwise the one engine's, however many workers share it.

Versions: `load_weights(version, tensors)` puts the tensors in the object store once and every
worker loads them; every `generate` shard carries the version it expects (and the reference to
its tensors), and a worker on another version — e.g. restarted by Ray with its step-0 weights —
reloads before sampling. Faults: a worker that dies (or does not answer within ``timeout_s``)
is waited for until Ray has restarted it (``max_restarts``; calls are never retried by Ray), and
its shard is issued again, so the step's rollouts are what they would have been.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import ray
import torch

from rltt.errors import RlttError
from rltt.orchestration.ray import shards
from rltt.orchestration.ray.cluster import DEAD_ACTOR_ERRORS, ClusterLog, actor_env, actor_info, wait_scheduled
from rltt.orchestration.orchestration_section import RaySection
from rltt.rollout import RolloutBatch, RolloutEngine, SamplingParams

ROLE = "rollout"


class RemoteTensors(Mapping):
    """Weights that stay in the object store: a `RayRolloutPool` hands the reference on to its
    workers without fetching it; any other reader fetches the tensors on first access."""

    def __init__(self, ref: ray.ObjectRef, timeout_s: float):
        self.ref, self.timeout_s, self._local = ref, timeout_s, None

    def _tensors(self) -> dict[str, torch.Tensor]:
        if self._local is None:
            self._local = ray.get(self.ref, timeout=self.timeout_s)
        return self._local

    def __getitem__(self, key):
        return self._tensors()[key]

    def __iter__(self):
        return iter(self._tensors())

    def __len__(self):
        return len(self._tensors())


class RolloutWorker:
    """The actor: one engine, the weights version it serves."""

    def __init__(self, index: int, build: Callable[[], RolloutEngine], threads: int = 1):
        torch.set_num_threads(threads)
        self.index = index
        self.engine = build()
        self.version = 0

    def info(self) -> dict:
        return {**actor_info(ROLE, self.index), "version": self.version}

    def load(self, version: int, box: list | None) -> int:
        """Take weights ``version`` (``box`` = [ObjectRef of the tensors], kept unresolved by Ray)."""
        if version != self.version:
            if not box:
                raise RlttError(f"rollout worker {self.index}: weights version {version} requested without tensors")
            self.engine.load_weights(version, ray.get(box[0]))
            self.version = version
        return self.version

    def generate(self, prompts: list[list[int]], params: SamplingParams, version: int,
                 box: list | None) -> tuple[RolloutBatch, bool]:
        """Sample at weights ``version`` (reloading first when this worker serves another one);
        returns the batch and whether it had to reload."""
        stale = version != self.version
        self.load(version, box)
        return self.engine.generate(prompts, params), stale


@dataclass
class _Shard:
    worker: int
    start: int
    end: int
    params: SamplingParams
    ref: Any = None
    tries: int = 0


class PendingRollout:
    """A `generate` call in flight; `result()` collects (and repairs) it."""

    def __init__(self, pool: "RayRolloutPool", prompts, params: SamplingParams, parts: list[_Shard], t0: float):
        self.pool, self.prompts, self.params, self.parts, self.t0 = pool, prompts, params, parts, t0

    def result(self) -> RolloutBatch:
        batches = self.pool._collect(self.prompts, self.parts)
        self.pool.worker_s += max(b.stats.wall_time for b in batches)
        return shards.merge(batches, self.params, time.perf_counter() - self.t0)


class RayRolloutPool(RolloutEngine):
    """N rollout-worker actors behind the `RolloutEngine` interface (see the module docstring)."""

    def __init__(self, build: Callable[[], RolloutEngine], cfg: RaySection, log: ClusterLog | None = None,
                 workers: int | None = None):
        self.cfg = cfg
        self.log = log or ClusterLog(None)
        self.weights_version = 0
        self.reloads = 0  # shards whose worker served another version and reloaded first
        self.reissued = 0  # shards issued again after their worker died or hung
        self.worker_s = 0.0  # seconds the workers spent generating (the slowest shard of each call), summed
        self._box: list | None = None
        count = workers or cfg.rollout_workers
        actor = ray.remote(RolloutWorker).options(
            num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, max_restarts=cfg.max_restarts, max_task_retries=0,
            runtime_env={"env_vars": actor_env(cfg.threads)})
        self.workers = [actor.remote(i, build, cfg.threads) for i in range(count)]
        for info in wait_scheduled(self.workers, cfg, "rollout-worker"):
            self.log.started(info)

    # -- the interface --------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        return self.submit(prompts, params).result()

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Publish ``version`` once through the object store and have every worker load it (a
        worker that is down takes it on its next call)."""
        ref = tensors.ref if isinstance(tensors, RemoteTensors) else ray.put(dict(tensors))
        self._box, self.weights_version = [ref], version
        calls = [w.load.remote(version, self._box) for w in self.workers]
        for call in calls:
            try:
                ray.get(call, timeout=self.cfg.timeout_s)
            except DEAD_ACTOR_ERRORS:
                pass  # reloads before its next shard

    # -- shards -------------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], params: SamplingParams) -> PendingRollout:
        """Dispatch a `generate` call and return at once. Without ``prompt_seeds`` (rows keyed by
        their index in the call) the call cannot be split and goes to one worker whole."""
        t0 = time.perf_counter()
        if params.prompt_seeds is None:
            parts = [_Shard(0, 0, len(prompts), params)]
        else:
            params.check_prompt_seeds(len(prompts))
            parts = [_Shard(i, a, b, shards.shard_params(params, a, b))
                     for i, (a, b) in enumerate(shards.split(len(prompts), len(self.workers)))]
        for part in parts:
            self._issue(prompts, part)
        return PendingRollout(self, prompts, params, parts, t0)

    def _issue(self, prompts, part: _Shard) -> None:
        part.ref = self.workers[part.worker].generate.remote(
            prompts[part.start:part.end], part.params, self.weights_version, self._box)

    def _collect(self, prompts, parts: list[_Shard]) -> list[RolloutBatch]:
        out: dict[int, RolloutBatch] = {}
        while len(out) < len(parts):
            pending = [p for p in parts if p.worker not in out]
            ready, _ = ray.wait([p.ref for p in pending], num_returns=1, timeout=self.cfg.timeout_s)
            if not ready:  # no shard finished within the timeout: restart the first one's worker
                part = pending[0]
                ray.kill(self.workers[part.worker], no_restart=False)
                self._repair(prompts, part, "did not answer within timeout_s")
                continue
            for part in pending:
                if part.ref not in ready:
                    continue
                try:
                    batch, stale = ray.get(part.ref, timeout=self.cfg.timeout_s)
                except DEAD_ACTOR_ERRORS as exc:
                    self._repair(prompts, part, type(exc).__name__)
                    continue
                self.reloads += int(stale)
                out[part.worker] = batch
        return [out[p.worker] for p in parts]

    def _repair(self, prompts, part: _Shard, why: str) -> None:
        """Wait for Ray to bring the shard's worker back, then issue the shard again."""
        part.tries += 1
        if part.tries > self.cfg.max_restarts:
            raise RlttError(f"orchestration.ray.max_restarts: rollout worker {part.worker} failed "
                            f"{part.tries} times ({why}); the run stops (resume it with --resume)")
        self.log.state(ROLE, part.worker, "restarting")
        self.log.started(self._wait_alive(part.worker, why))
        self.reissued += 1
        self._issue(prompts, part)

    def _wait_alive(self, index: int, why: str) -> dict:
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RlttError(f"orchestration.ray.timeout_s: rollout worker {index} ({why}) was not back "
                                f"within {self.cfg.timeout_s:g} s")
            try:
                return ray.get(self.workers[index].info.remote(), timeout=min(left, 5.0))
            except DEAD_ACTOR_ERRORS:
                time.sleep(0.2)

    def worker_infos(self) -> list[dict]:
        return [ray.get(w.info.remote(), timeout=self.cfg.timeout_s) for w in self.workers]

    def close(self) -> None:
        """Stop every rollout worker."""
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
