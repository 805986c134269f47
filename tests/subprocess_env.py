"""The environment of a test's worker subprocess (torchrun / DeepSpeed / ``rltt train``)."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# In-process DeepSpeed tests leave a one-process group's rendezvous in os.environ; a worker that
# inherited it would bind the same port, which that group still holds.
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def worker_env(**extra: str) -> dict[str, str]:
    """os.environ less any rendezvous, with the repository on PYTHONPATH and one OpenMP thread."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "rltt" / "torch_extensions"))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", **extra)
    return env
