"""`RayLearnerGroup`: a `Learner` made of M learner actors forming one torch.distributed group.

The actors are placed with a placement group (one bundle per learner, packed); rank 0 reports
its node address and a free port and every rank joins the process group from there (gloo on
CPU, NCCL on GPU) — no torchrun environment. Each rank trains the rltt learner on its
contiguous share of the batch; the learner reduces the metrics over the group, so rank 0's are
the global batch's. `rollout_state_dict` gathers on every rank (ZeRO-3) and returns rank 0's
tensors as a reference into the object store (the driver never copies them). `save` / `load`
are collective. A learner that dies stops the step with `LearnerGroupDied`, a one-line error
naming the checkpoint to resume from (a group cannot continue without one of its ranks); the
Ray trainer catches it and rebuilds the group from that checkpoint
(``orchestration.ray.learner_restarts``).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Callable

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rltt.errors import RlttError
from rltt.learner import LearnerBatch
from rltt.orchestration.parts import PartDied
from rltt.orchestration.ray.cluster import (DEAD_ACTOR_ERRORS, ClusterLog, actor_env, actor_info, resources_error,
                                            wait_scheduled)
from rltt.orchestration.orchestration_section import RaySection
from rltt.orchestration.ray.rollout_pool import RemoteTensors

ROLE = "learner"


class LearnerGroupDied(PartDied):
    """A learner actor died: the group cannot go on. ``checkpoint`` is the newest complete
    checkpoint (None before the first), the one a restart resumes from."""


class LearnerWorker:
    """The actor: rank ``rank`` of ``world``; builds its learner once the group is formed."""

    def __init__(self, rank: int, world: int, build: Callable, threads: int = 1):
        torch.set_num_threads(threads)
        self.rank, self.world, self.build = rank, world, build
        self.learner = None

    def info(self) -> dict:
        return actor_info(ROLE, self.rank)

    def rendezvous(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, address: str, port: int, timeout_s: float) -> int:
        if self.world > 1:
            import datetime

            os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(self.rank),
                              WORLD_SIZE=str(self.world), LOCAL_RANK="0")
            if torch.cuda.is_available():
                torch.cuda.set_device(0)  # Ray gives each learner its own visible GPU
            torch.distributed.init_process_group(
                "nccl" if torch.cuda.is_available() else "gloo", init_method=f"tcp://{address}:{port}",
                rank=self.rank, world_size=self.world, timeout=datetime.timedelta(seconds=timeout_s))
        self.learner = self.build(self.rank, self.world)
        return self.learner.version

    def update(self, batch: LearnerBatch) -> tuple[dict[str, float], float, int]:
        """The update's metrics, its wall time on this rank and the version after it (unchanged
        when the non-finite guard skipped the update)."""
        t0 = time.perf_counter()
        metrics = self.learner.update(batch)
        return metrics, time.perf_counter() - t0, self.learner.version

    def sequence_kl(self, batch: LearnerBatch) -> torch.Tensor:
        return self.learner.sequence_kl(batch)

    def rollout_state_dict(self):
        version, tensors = self.learner.rollout_state_dict()
        return version, (tensors if self.rank == 0 else None)

    def save(self, directory: str) -> int:
        self.learner.save(Path(directory))
        return self.learner.version

    def load(self, directory: str) -> int:
        self.learner.load(Path(directory))
        return self.learner.version

    def close(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class RayLearnerGroup:
    """M learner actors behind the `Learner` interface (see the module docstring)."""

    def __init__(self, build: Callable, cfg: RaySection, log: ClusterLog | None = None,
                 learners: int | None = None):
        self.cfg = cfg
        self.log = log or ClusterLog(None)
        self.world = learners or cfg.learners
        self.last_checkpoint: Path | None = None
        #: called between starting an update and waiting for it (``orchestration.max_staleness``)
        self.during_update: Callable[[], None] | None = None
        self.last_update_s = 0.0  # the slowest rank's wall time of the last update
        self._in_flight: list | None = None  # the update in flight (its ranks' result refs)
        self._finished: tuple[dict[str, float], float] | None = None  # the last update's result
        self._weights: tuple[int, RemoteTensors] | None = None  # rollout_state_dict of the current version
        bundle = {"CPU": cfg.num_cpus, "GPU": cfg.num_gpus}
        bundle = {k: v for k, v in bundle.items() if v > 0}
        self.pg = None
        strategy = None
        if bundle:  # nothing to reserve when actors take no resources
            self.pg = placement_group([dict(bundle) for _ in range(self.world)], strategy="PACK")
            ready, _ = ray.wait([self.pg.ready()], timeout=cfg.timeout_s)
            if not ready:
                remove_placement_group(self.pg)
                raise resources_error(ROLE, self.world, cfg, extra=" (one placement group)")
        actor = ray.remote(LearnerWorker)
        self.workers = []
        for rank in range(self.world):
            if self.pg is not None:
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
            self.workers.append(actor.options(
                num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, max_restarts=0, max_task_retries=0,
                scheduling_strategy=strategy, runtime_env={"env_vars": actor_env(cfg.threads)},
            ).remote(rank, self.world, build, cfg.threads))
        for info in wait_scheduled(self.workers, cfg, ROLE):
            self.log.started(info)
        address, port = self._get(self.workers[0].rendezvous.remote(), "forming the learner group")
        versions = self._all([w.setup.remote(address, port, cfg.timeout_s) for w in self.workers],
                             "building the learners")
        self.version = versions[0]

    # -- calls on the group -----------------------------------------------------------------
    def _get(self, ref, what: str):
        try:
            return ray.get(ref, timeout=self.cfg.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RlttError(f"orchestration.ray.timeout_s: {what} took longer than {self.cfg.timeout_s:g} s"
                            f"{self._resume_hint()}") from None
        except DEAD_ACTOR_ERRORS as exc:
            for i, w in enumerate(self.workers):
                self.log.state(ROLE, i, "dead" if not self._alive(w) else "alive")
            raise LearnerGroupDied(f"orchestration.ray: a learner died while {what} ({type(exc).__name__})"
                                   f"{self._resume_hint()}", self.last_checkpoint) from None

    def _all(self, refs: list, what: str) -> list:
        """Every rank's result, in rank order; the first rank to fail (a dead rank leaves the others
        waiting in a collective) ends the wait at once."""
        out: dict = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=self.cfg.timeout_s)
            if not ready:
                return [self._get(ref, what) for ref in refs]  # the timeout error
            out[ready[0]] = self._get(ready[0], what)
        return [out[ref] for ref in refs]

    @staticmethod
    def _alive(worker) -> bool:
        try:
            ray.get(worker.info.remote(), timeout=2)
            return True
        except Exception:  # noqa: BLE001 - any failure means it does not answer
            return False

    def _resume_hint(self) -> str:
        if self.last_checkpoint is None:
            return "; no checkpoint yet: start the run again"
        return f"; resume from {self.last_checkpoint} with --resume"

    def _shares(self, batch: LearnerBatch) -> list[LearnerBatch]:
        if batch.size % self.world:
            raise RlttError(f"orchestration.ray.learners: a batch of {batch.size} sequences does not split "
                            f"over {self.world} learners")
        per = batch.size // self.world
        return [batch.select(slice(r * per, (r + 1) * per)) for r in range(self.world)]

    # -- the Learner interface ------------------------------------------------------------
    def update(self, batch: LearnerBatch) -> dict[str, float]:
        """Every rank trains on its share; the metrics are the global batch's (rank 0's)."""
        self._in_flight, self._finished = self.submit_update(batch), None
        del batch  # the shares stay in the object store only until the ranks have them
        if self.during_update is not None:
            self.during_update()  # may collect the update itself (`poll_update`)
        self.poll_update(wait=True)
        return self._finished[0]

    def poll_update(self, wait: bool = False) -> bool:
        """Whether the update started by `update` has finished, collecting it (version, metrics)
        when it has; ``wait``: until it has. True when none is in flight."""
        if self._in_flight is None:
            return True
        if not wait:
            ready, _ = ray.wait(self._in_flight, num_returns=len(self._in_flight), timeout=0)
            if len(ready) < len(self._in_flight):
                return False
        refs, self._in_flight = self._in_flight, None
        self._finished = self.finish_update(refs)
        return True

    def submit_update(self, batch: LearnerBatch) -> list:
        """Start an update and return at once (the driver may sample meanwhile)."""
        return [w.update.remote(share) for w, share in zip(self.workers, self._shares(batch))]

    def finish_update(self, refs: list) -> tuple[dict[str, float], float]:
        """Rank 0's metrics (those of the global batch) and the slowest rank's update seconds."""
        results = self._all(refs, f"updating to version {self.version + 1}")
        self.version = results[0][2]  # a skipped (non-finite) update keeps the version
        self.last_update_s = max(seconds for _, seconds, _ in results)
        return results[0][0], self.last_update_s

    def sequence_kl(self, batch: LearnerBatch) -> torch.Tensor:
        parts = self._all([w.sequence_kl.remote(s) for w, s in zip(self.workers, self._shares(batch))],
                          "computing the sequence KL")
        return torch.cat(parts)

    def rollout_state_dict(self) -> tuple[int, RemoteTensors]:
        """The rollout weights of the current version (gathered once per version)."""
        if self._weights is not None and self._weights[0] == self.version:
            return self._weights
        calls = [w.rollout_state_dict.options(num_returns=2).remote() for w in self.workers]
        versions = self._all([v for v, _ in calls], "gathering the rollout weights")
        ready, _ = ray.wait([calls[0][1]], timeout=self.cfg.timeout_s)
        if not ready:
            raise RlttError(f"orchestration.ray.timeout_s: the rollout weights were not ready within "
                            f"{self.cfg.timeout_s:g} s{self._resume_hint()}")
        self._weights = (versions[0], RemoteTensors(calls[0][1], self.cfg.timeout_s))
        return self._weights

    def save(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._all([w.save.remote(str(directory)) for w in self.workers], f"saving to {directory}")

    def load(self, directory: Path) -> None:
        versions = self._all([w.load.remote(str(directory)) for w in self.workers], f"loading {directory}")
        self.version, self._weights = versions[0], None
        self.last_checkpoint = Path(directory)

    def checkpointed(self, directory: Path) -> None:
        """The checkpoint ``directory`` is complete: the one to name if a learner dies."""
        self.last_checkpoint = Path(directory)

    def worker_infos(self) -> list[dict]:
        return [ray.get(w.info.remote(), timeout=self.cfg.timeout_s) for w in self.workers]

    def close(self) -> None:
        """Stop every learner actor (and its process group) and free its placement group."""
        closing = [w.close.remote() for w in self.workers]
        ray.wait(closing, num_returns=len(closing), timeout=10)  # a dead or hung rank is killed anyway
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
