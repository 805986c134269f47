"""What the bench scripts that run ``rltt`` commands share (`bench/algorithms.py`,
`bench/compute.py`): the ``rltt train`` command of one run and what ``--smoke`` shrinks, the
subprocess call and its environment, the command line as text, a failed call's last lines, reading
a run's metrics, a median and a mean ± SE over seeds that skip what is not a finite number. Not a
benchmark itself."""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what ``--smoke`` shrinks in the quickstart recipe (besides the seeds, steps and evaluation samples)
SMOKE_OVERRIDES = ("data.eval_size=8", "train.eval_samples=1", "rollout.prompts_per_step=2", "rollout.group_size=4",
                   "rollout.max_new_tokens=12", "learner.micro_batch_size=8")


def train_argv(recipe: str, overrides: list[str], steps: int, run_dir: Path, checkpoint_every: int = 0,
               keep_final: bool = False) -> list[str]:
    """``rltt train RECIPE OVERRIDES`` for ``steps`` steps with held-out evaluations at the start and
    the end, one thread, quiet, into ``run_dir``; a checkpoint every ``checkpoint_every`` steps (0:
    none) and the final one unless it is neither asked for nor needed (``keep_final``)."""
    argv = ["train", recipe, *overrides, f"train.steps={steps}", f"train.eval_every={steps}", "train.threads=1",
            f"logging.run_dir={run_dir}", "logging.progress=false", "logging.review_at_end=false",
            f"checkpoint.every={checkpoint_every}"]
    return argv if checkpoint_every or keep_final else [*argv, "checkpoint.save_final=false"]


def command(argv: list[str]) -> str:
    """``rltt ARGV`` as a shell command line."""
    return "rltt " + " ".join(shlex.quote(a) for a in argv)


def child_env() -> dict:
    """The environment of an ``rltt`` subprocess: this checkout first on the path, one thread each
    (OpenMP threads stall when other processes share the cores)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def call_rltt(argv: list[str], log: Path, append: bool = False) -> int:
    """Run ``rltt ARGV`` from the repository root, its command line then its output in ``log``."""
    with log.open("a" if append else "w") as f:
        f.write(command(argv) + "\n\n")
        f.flush()
        return subprocess.call([sys.executable, "-m", "rltt.cli.main", *argv], cwd=ROOT, env=child_env(),
                               stdout=f, stderr=subprocess.STDOUT)


def failure(log: Path, code: int) -> str:
    """A failed call's error: its exit status and the last lines of its log."""
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return f"exit status {code}: " + " | ".join(tail)


def read_records(run_dir: Path) -> list[dict]:
    from rltt.telemetry import read_metrics

    return read_metrics(run_dir)


def median(values) -> float:
    """The median of the finite numbers in ``values`` (NaN if none)."""
    v = sorted(x for x in values if isinstance(x, (int, float)) and math.isfinite(x))
    if not v:
        return float("nan")
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def mean_se(values) -> tuple[float, float]:
    """Mean ± standard error over seeds of the finite numbers in ``values`` (SE NaN with one)."""
    v = [x for x in values if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return float("nan"), float("nan")
    m = sum(v) / len(v)
    se = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v)) if len(v) > 1 else float("nan")
    return m, se
