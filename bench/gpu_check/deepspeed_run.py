"""The ``deepspeed`` section: bench/gpu_check_deepspeed.py in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .context import ROOT, Context
from .report import Deadline, SectionResult, take_worker_result

# -- DeepSpeed: the default GPU path ---------------------------------------------------------------------
def section_deepspeed(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    """bench/gpu_check_deepspeed.py in its own process (this one keeps DeepSpeed unimportable),
    given the section's time less its start-up; its figures, failures and skipped sub-steps are
    this section's. Its output goes to this log. Without DeepSpeed installed the section is
    ``absent`` with a note (the GPU image: carry bench/gpu_bundle.sh's wheels)."""
    worker = ROOT / "bench" / "gpu_check_deepspeed.py"
    held = 0
    if ctx.cuda:  # this process's share of the GPU (the worker's 80 GB card leaves it out)
        import torch

        ctx._model = None  # the Ouro-shaped model of the sections before (rebuilt by a later one)
        ctx.release()
        free, total = torch.cuda.mem_get_info(ctx.device)
        held = total - free
    with tempfile.TemporaryDirectory(prefix="rltt-gpu-check-ds-") as name:
        cmd = [sys.executable, str(worker), "--out", name, "--budget", f"{max(deadline.left() - 20, 1):.0f}",
               "--held-elsewhere", str(held)]
        cmd += ["--cpu-smoke"] if ctx.cpu_smoke else []
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=max(deadline.left() - 2, 1))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "killed at the section's budget"
        result_file = Path(name) / "deepspeed.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else None
    if result is None:
        raise RuntimeError(f"bench/gpu_check_deepspeed.py exited with {code} before writing its figures")
    if take_worker_result(sec, "deepspeed", result) and code:
        sec.failures.append(f"bench/gpu_check_deepspeed.py exited with {code}")


