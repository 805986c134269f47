"""A stale build lock of a torch C++ extension, left by a process killed while it built the op.

PyTorch builds a JIT extension (DeepSpeed's CPU communication op, ``deepspeed_shm_comm``, on a
machine without CUDA) under a file lock, ``<torch extensions dir>/<name>/lock``, that it creates
before the build and removes after it. A process killed during the build (kill -9, a timeout, a
stopped test run) leaves the file behind, and every later process waits for it forever, silently.
`clear_stale_build_lock` removes such a lock when it is older than any build takes, and says so.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

#: a lock older than this is left by a dead builder (building DeepSpeed's CPU comm op takes about a minute)
STALE_S = 600.0


def build_dir(name: str) -> Path:
    """Where torch builds the JIT extension ``name`` (``TORCH_EXTENSIONS_DIR`` respected)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def clear_stale_build_lock(name: str, stale_s: float = STALE_S, now: float | None = None) -> bool:
    """Remove ``name``'s build lock if it is older than ``stale_s`` seconds; True when one was removed."""
    lock = build_dir(name) / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < stale_s:
        return False  # a build may be running: wait for it as torch does
    lock.unlink(missing_ok=True)
    print(f"rltt: removed a stale build lock of the {name} extension ({lock}, {age / 60:.0f} min old): a process "
          f"was killed while building it", file=sys.stderr)
    return True
