"""The ``vllm`` section: bench/gpu_check_vllm.py in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .context import ROOT, Context
from .report import Deadline, SectionResult, take_worker_result

# -- vLLM ---------------------------------------------------------------------------------------------
def section_vllm(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    """bench/gpu_check_vllm.py in its own process (this one keeps vLLM unimportable); its figures
    are this section's. Without vLLM installed the section is ``absent`` with a note."""
    worker = ROOT / "bench" / "gpu_check_vllm.py"
    with tempfile.TemporaryDirectory(prefix="rltt-gpu-check-vllm-") as name:
        cmd = [sys.executable, str(worker), "--out", name] + (["--cpu-smoke"] if ctx.cpu_smoke else [])
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(deadline.left() - 5, 1))
        result_file = Path(name) / "vllm.json"
        if proc.returncode or not result_file.exists():
            raise RuntimeError(f"bench/gpu_check_vllm.py exited with {proc.returncode}: {proc.stderr[-1500:]}")
        result = json.loads(result_file.read_text())
    take_worker_result(sec, "vllm", result)

