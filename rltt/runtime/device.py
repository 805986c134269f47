"""Device selection for every run (RL training, pretraining, conversion, evaluation).

``model.device: cuda[:i]`` on a machine where CUDA is unusable stops the command before it loads or
writes anything, in one line that says why (`cuda_unusable`): torch built without CUDA, no NVIDIA
driver, a driver older than the CUDA major torch is built for (the driver's own CUDA version,
``cuDriverGetVersion`` of ``libcuda.so.1``, against ``torch.version.cuda``), or torch.cuda's own
error. ``auto`` picks CUDA when it is usable, else the CPU, and says so on stderr when a driver is
present but CUDA still cannot be used (a silent CPU run of a GPU recipe is the trap).
"""

from __future__ import annotations

import functools
import os
import re
import sys

import torch

from rltt.config import recipe_error

#: the oldest Linux driver for each CUDA major (NVIDIA's CUDA toolkit release notes, "minor version
#: compatibility": any driver of at least this release runs every x.y of that major)
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"


def driver_cuda_version() -> tuple[int, int] | None:
    """(major, minor) of the newest CUDA the installed NVIDIA driver supports (``cuDriverGetVersion``
    of ``libcuda.so.1``, which needs no GPU and no ``cuInit``); None without a driver."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    try:
        status = lib.cuDriverGetVersion(ctypes.byref(version))
    except AttributeError:
        return None
    if status != 0 or version.value <= 0:
        return None
    return version.value // 1000, version.value % 1000 // 10


def driver_release(path: str = DRIVER_VERSION_FILE) -> str | None:
    """The NVIDIA kernel module's release (``580.65.06``) from ``/proc/driver/nvidia/version``; None
    where it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return m.group(1) if m else None


def _version(text: str) -> tuple[int, int]:
    parts = [int(p) for p in re.findall(r"\d+", text)[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def _torch_cuda_error() -> str | None:
    """torch.cuda's own reason for refusing (the first line of ``torch.cuda.init()``'s error)."""
    try:
        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001 - its message is the reason
        lines = str(exc).strip().splitlines()
        return lines[0].strip() if lines else type(exc).__name__
    return None


def cuda_unusable(index: int = 0) -> str | None:
    """Why CUDA device ``index`` cannot be used here, in one line (None: it can)."""
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is built without CUDA: install a CUDA build of torch "
                "(pip install torch --index-url https://download.pytorch.org/whl/cu130)")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if index >= count:
            return f"only {count} CUDA device(s) are visible"
        return None
    runtime = _version(torch.version.cuda)
    driver = driver_cuda_version()
    if driver is None:
        return ("no NVIDIA driver here (libcuda.so.1 does not load): no GPU on this machine, or a container "
                "started without --gpus")
    release = driver_release()
    have = f"the NVIDIA driver{f' {release}' if release else ''} supports CUDA up to {driver[0]}.{driver[1]}"
    if driver[0] < runtime[0]:
        need = MIN_DRIVER.get(runtime[0])
        return (f"{have} but torch {torch.__version__} is built for CUDA {torch.version.cuda}: update the driver"
                f"{f' to >= {need}' if need else ''} or install torch built for CUDA {driver[0]}")
    own = _torch_cuda_error()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if own is None:
        own = "no CUDA device is visible"
    if visible is not None:
        own += f" (CUDA_VISIBLE_DEVICES={visible!r})"
    return f"torch.cuda: {own}; {have}, torch {torch.__version__} is built for CUDA {torch.version.cuda}"


@functools.lru_cache(maxsize=None)
def _warn_cpu_fallback(key: str, reason: str) -> None:
    print(f"WARNING: {key}=auto runs on the CPU: an NVIDIA driver is installed but CUDA is unusable: {reason} "
          f"(set {key}=cpu to silence this, or fix CUDA)", file=sys.stderr)


def pick_device(name: str, key: str = "model.device") -> torch.device:
    """``auto`` (CUDA when usable, else CPU) or a torch device name; a CUDA device where CUDA is
    unusable is a one-line error naming ``key`` and the reason (`cuda_unusable`)."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.version.cuda is not None and driver_cuda_version() is not None:
            _warn_cpu_fallback(key, cuda_unusable() or "torch.cuda.is_available() is False")
        return torch.device("cpu")
    if name.startswith("cuda"):
        require_cuda(name, key)
    return torch.device(name)


def require_cuda(name: str, key: str = "model.device") -> None:
    """Stop, in one line naming ``key``, when ``name`` (``cuda[:i]``) cannot be used here; nothing
    for another device name. Commands call it right after loading their recipe."""
    if not name.startswith("cuda"):
        return
    reason = cuda_unusable(int(name.partition(":")[2] or 0))
    if reason is not None:
        raise recipe_error(key, f"is {name!r} but CUDA is unusable here: {reason}; or run on the CPU: {key}=cpu")
