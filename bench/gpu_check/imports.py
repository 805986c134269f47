"""The ``imports`` section: every rltt module imports with deepspeed, ray and vllm unimportable."""

from __future__ import annotations

import importlib
import sys

from .context import HEAVY, Context
from .report import Deadline, SectionResult

# -- imports ------------------------------------------------------------------------------------------
def section_imports(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    import pkgutil

    import rltt

    failed, count = [], 0
    # the optional layers that exist to drive ray / vllm need them by design; everything else must not
    optional = ("rltt.vllm", "rltt.orchestration.ray")
    for info in pkgutil.walk_packages(rltt.__path__, "rltt."):
        if info.name.startswith(optional) and info.name not in optional:
            continue
        count += 1
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # noqa: BLE001 - recorded
            failed.append(f"{info.name}: {type(exc).__name__}: {exc}"[:300])
    for name in ("rewards.gsm8k", "rewards.format"):
        count += 1
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001
            failed.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY and sys.modules[m] is not None)
    setting = ("deepspeed, ray, vllm made unimportable; HF_HUB_OFFLINE=1; every rltt module but those under "
               "rltt.vllm and rltt.orchestration.ray (they drive vllm / ray)")
    sec.add("modules_imported", count - len(failed), "modules", setting)
    sec.add("modules_failed", len(failed), "modules", setting + ("; failed: " + "; ".join(failed) if failed else ""))
    sec.add("heavy_modules_loaded", len(loaded), "modules",
            setting + ("; loaded: " + ", ".join(loaded) if loaded else ""))
    if failed:
        raise RuntimeError(f"{len(failed)} rltt module(s) failed to import: {failed[0]}")

