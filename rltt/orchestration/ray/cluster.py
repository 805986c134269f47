"""Starting or joining a Ray cluster, creating actors that are known to be scheduled, and
``RUN_DIR/cluster.json`` (which actor runs where, its pid and how often it was restarted).

Environment variables reach actors only through ``runtime_env`` (set after ``ray.init`` they
never do), so every actor is created with the driver's rltt-relevant variables. A local cluster
uses ``address="local"``: a session file left by a killed ``ray start`` cannot make the driver
wait for a dead cluster.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray

from rltt.errors import RlttError
from rltt.orchestration.orchestration_section import RaySection

#: forwarded to every actor when set in the driver
FORWARDED_ENV = ("PYTHONPATH", "TORCH_EXTENSIONS_DIR", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HF_HOME",
                 "TRITON_INTERPRET", "RAY_AUTH_MODE", "CUDA_DEVICE_ORDER",
                 "PYTORCH_CUDA_ALLOC_CONF")  # the allocator setting: `rltt.runtime.allocator`
ZERO_COPY = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}  # tensors in the object store are read in place
DEAD_ACTOR_ERRORS = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError,
                     ray.exceptions.GetTimeoutError)


def actor_env(threads: int = 1) -> dict[str, str]:
    import rltt

    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    root = str(Path(rltt.__file__).resolve().parents[1])  # this rltt, also when it is not installed
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(ZERO_COPY, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def connect(cfg: RaySection) -> bool:
    """Join the cluster at ``cfg.address`` or start a local one; True when this call started Ray
    (and `disconnect` should stop it). An already initialised Ray (a test session) is reused."""
    if ray.is_initialized():
        return False
    for key, value in ZERO_COPY.items():
        os.environ.setdefault(key, value)  # the driver reads tensors in place too
    if cfg.address is None:
        ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                 object_store_memory=cfg.object_store_mb * 1024**2, log_to_driver=True,
                 runtime_env={"env_vars": actor_env(cfg.threads)})
    else:
        try:
            ray.init(address=cfg.address, runtime_env={"env_vars": actor_env(cfg.threads)})
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RlttError(f"orchestration.ray.address: cannot connect to {cfg.address!r} "
                            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    return True


def disconnect(started: bool) -> None:
    if started and ray.is_initialized():
        ray.shutdown()


def get(refs, cfg: RaySection, what: str):
    """``ray.get`` that never waits longer than ``timeout_s``: past it, a one-line `RlttError`."""
    try:
        return ray.get(refs, timeout=cfg.timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RlttError(f"orchestration.ray.timeout_s: {what} took longer than {cfg.timeout_s:g} s") from None


def resources_error(role: str, count: int, cfg: RaySection, extra: str = "") -> RlttError:
    avail = ray.available_resources()
    have = ", ".join(f"{k} {v:g}" for k, v in sorted(avail.items()) if k in ("CPU", "GPU")) or "nothing"
    return RlttError(f"orchestration.ray: {count} {role} actor(s) with num_cpus={cfg.num_cpus:g}, "
                     f"num_gpus={cfg.num_gpus:g} each{extra} could not be scheduled within timeout_s="
                     f"{cfg.timeout_s:g} s (the cluster has {have} available)")


def wait_scheduled(actors: list, cfg: RaySection, role: str) -> list[dict]:
    """Each actor's `info()` once it runs; an actor still pending after ``timeout_s`` (the cluster
    lacks the resources) is an error, not a hang."""
    refs = [a.info.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=cfg.timeout_s)
    if len(ready) < len(refs):
        for a in actors:
            ray.kill(a, no_restart=True)
        raise resources_error(role, len(actors), cfg)
    return ray.get(refs, timeout=cfg.timeout_s)


def actor_info(role: str, index: int) -> dict:
    """What an actor reports about itself (called inside the actor)."""
    ctx = ray.get_runtime_context()
    return {"role": role, "index": index, "pid": os.getpid(), "node": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(), "actor_id": ctx.get_actor_id()}


@dataclass
class ActorRecord:
    role: str
    index: int
    pid: int
    node: str
    ip: str
    restarts: int = 0
    state: str = "alive"


class ClusterLog:
    """``RUN_DIR/cluster.json``: one record per actor, rewritten (atomically) whenever one changes;
    ``learner_group_restarts``: how often the run rebuilt its learner group (and so its actors)."""

    def __init__(self, path: Path | None, learner_group_restarts: int = 0):
        self.path = path
        self.learner_group_restarts = learner_group_restarts
        self.records: dict[tuple[str, int], ActorRecord] = {}
        self._lock = threading.Lock()

    def started(self, info: dict) -> None:
        key = (info["role"], info["index"])
        with self._lock:
            old = self.records.get(key)
            restarts = old.restarts + (old.pid != info["pid"]) if old else 0
            self.records[key] = ActorRecord(info["role"], info["index"], info["pid"], info["node"], info["ip"],
                                            restarts)
        self.write()

    def state(self, role: str, index: int, state: str) -> None:
        with self._lock:
            if (role, index) in self.records:
                self.records[(role, index)].state = state
        self.write()

    def restarts(self, role: str | None = None) -> int:
        return sum(r.restarts for r in self.records.values() if role is None or r.role == role)

    def write(self) -> None:
        if self.path is None:
            return
        with self._lock:
            doc: dict[str, Any] = {"updated": time.time(), "learner_group_restarts": self.learner_group_restarts,
                                   "actors": [asdict(r) for r in self.records.values()]}
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc, indent=1))
            os.replace(tmp, self.path)
