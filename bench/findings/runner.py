"""The arms of the findings and their scheduler: how big each arm is (`Scale`), one unit of work
(`Arm`: an ``rltt`` command run as a subprocess, or an in-process function), `run_arms` (every arm
once its dependencies are done, ``--jobs`` at a time) and the ``rltt train`` command of an RL arm."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import bench._rltt_runs as runs
from bench._rltt_runs import child_env

ROOT = Path(__file__).resolve().parents[2]

RL_RECIPE = "recipes/quickstart.yaml"
#: loops of the quickstart model (and of the T = 4 pretraining arm)
T = 4


@dataclass(frozen=True)
class Scale:
    """How big each arm is."""

    seeds: int  # seeds of the band arms
    credit_seeds: int
    rl_steps: int  # RL steps of the band, dense and credit arms
    lr_steps: int  # RL steps of the learning-rate arms
    lr_seeds: int
    dense_seeds: int
    eval_size: int  # held-out problems of every RL evaluation ...
    eval_samples: int  # ... x samples each
    pool_per_preset: int  # band pool: prompts per difficulty preset
    curate_samples: int  # completions per prompt when curating
    depth_seeds: int = 1  # RL seeds per arm of the depth finding
    depth_pretrain_steps: int = 350  # pretraining steps of the depth finding's two arms
    depth_eval_size: int = 512  # held-out problems of every hop count together
    depth_source: str = "synthetic:chains"  # the depth finding's task (1–4 hops; synthetic:chains-easy: 0–3)
    depth_pretrain_overrides: tuple[str, ...] = ()  # recipe overrides of both depth pretraining arms (a wider block ...)
    pretrain: tuple[str, ...] = ()  # overrides of both pretraining arms
    reuse_t4: bool = True  # the T = 4 arm is the cached quickstart model
    credit_arms: tuple[str, ...] = ()  # the per-loop credit arms to run (empty: all)

    @property
    def n_eval(self) -> int:
        """Held-out samples of one RL evaluation."""
        return self.eval_size * self.eval_samples


FULL = Scale(seeds=1, credit_seeds=2, rl_steps=40, lr_steps=40, lr_seeds=1, dense_seeds=1, eval_size=256, eval_samples=2,
             pool_per_preset=128, curate_samples=16)
SMOKE = Scale(seeds=1, credit_seeds=1, rl_steps=3, lr_steps=3, lr_seeds=1, dense_seeds=1, eval_size=8, eval_samples=1,
              pool_per_preset=8, curate_samples=4, reuse_t4=False, depth_pretrain_steps=4, depth_eval_size=8,
              pretrain=("train.steps=4", "train.batch_size=4", "eval.every=4", "eval.loss_batches=1",
                        "eval.solve_problems=4", "eval.max_new_tokens=16", "data.held_out_docs=8",
                        "tokenizer.train_docs=200", "checkpoint.every=0", "logging.every=1"))


@dataclass
class Arm:
    """One unit of work: a CLI command (``argv`` after ``rltt``) or an in-process function."""

    name: str
    argv: list[str] | None = None
    fn: Callable[[], None] | None = None
    describe: str = ""  # what an in-process arm does
    deps: tuple[str, ...] = ()
    cost: float = 1.0  # relative estimate, orders the queue (critical path first)
    run_dir: Path | None = None
    status: str = "pending"  # pending | running | done | failed | skipped
    seconds: float = 0.0
    error: str = ""

    @property
    def command(self) -> str:
        return runs.command(self.argv) if self.argv else f"# {self.describe}"


def rel(path: Path) -> str:
    """``path`` relative to the repository root when it is inside it (shorter commands)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def train_argv(scale: Scale, run_dir: Path, seed: int, steps: int, extra: list[str],
               keep_final: bool = False) -> list[str]:
    """``rltt train`` of the quickstart recipe (`bench/_rltt_runs.train_argv`) at this scale's
    evaluation size: held-out evaluations at the start and the end, no checkpoint unless
    ``keep_final`` (the final one, for a later ``rltt eval``)."""
    return runs.train_argv(RL_RECIPE, [*extra, f"seed={seed}", f"data.eval_size={scale.eval_size}",
                                       f"train.eval_samples={scale.eval_samples}"], steps, rel(run_dir),
                           keep_final=keep_final)


def train_arm(out: Path, scale: Scale, name: str, seed: int, steps: int, extra: list[str], cost: float,
              deps: tuple[str, ...] = (), keep_final: bool = False) -> Arm:
    """An RL arm: ``rltt train`` of the quickstart recipe with ``extra`` overrides, run in ``OUT/runs/NAME``."""
    run = out / "runs" / name
    return Arm(name, train_argv(scale, run, seed, steps, extra, keep_final=keep_final), deps=deps, cost=cost,
               run_dir=run)


def eval_arm(name: str, checkpoint: Path | None, out_file: Path, samples: int, deps: tuple[str, ...],
             overrides: tuple[str, ...] = (), flags: tuple[str, ...] = ()) -> Arm:
    """``rltt eval`` of the quickstart recipe (with ``overrides``) on ``checkpoint`` (the recipe's
    ``model.path`` when None), ``samples`` per held-out problem, its result file written to ``out_file``."""
    argv = ["eval", RL_RECIPE, *overrides, *(["--model", rel(checkpoint)] if checkpoint is not None else []),
            *flags, "--samples", str(samples), "--out", rel(out_file)]
    return Arm(name, argv, deps=deps, cost=0.5)


def final_checkpoint(run_dir: Path, steps: int) -> Path:
    """The final checkpoint of an RL run of ``steps`` steps (kept by ``train_argv(..., keep_final=True)``)."""
    return run_dir / "checkpoints" / f"step-{steps:07d}"


def done_arms(arms: dict[str, Arm], prefix: str) -> list[Arm]:
    """The arms named ``prefix...`` that ran to the end."""
    return [a for a in arms.values() if a.name.startswith(prefix) and a.status == "done"]


def run_arms(arms: dict[str, Arm], logs: Path, jobs: int) -> None:
    """Run every arm once its dependencies are done, ``jobs`` at a time (longest chain first); an
    arm whose dependency failed is skipped."""
    logs.mkdir(parents=True, exist_ok=True)
    dependents: dict[str, list[str]] = {n: [] for n in arms}
    for arm in arms.values():
        for d in arm.deps:
            dependents[d].append(arm.name)
    chain: dict[str, float] = {}

    def chain_cost(name: str) -> float:  # the arm's cost plus its longest chain of dependents
        if name not in chain:
            chain[name] = arms[name].cost + max((chain_cost(d) for d in dependents[name]), default=0.0)
        return chain[name]

    lock = threading.Condition()
    env = child_env()
    total, finished = len(arms), [0]
    start = time.perf_counter()

    def work(arm: Arm) -> None:
        t0 = time.perf_counter()
        try:
            if arm.argv is not None:
                with (logs / f"{arm.name}.log").open("w") as log:
                    log.write(arm.command + "\n\n")
                    log.flush()
                    code = subprocess.call([sys.executable, "-m", "rltt.cli.main", *arm.argv], cwd=ROOT, env=env,
                                           stdout=log, stderr=subprocess.STDOUT)
                if code:
                    tail = (logs / f"{arm.name}.log").read_text(errors="replace").strip().splitlines()[-3:]
                    raise RuntimeError(f"exit status {code}: " + " | ".join(tail))
            else:
                arm.fn()
            status, error = "done", ""
        except Exception as exc:  # noqa: BLE001 - reported per arm, dependents skipped
            status, error = "failed", f"{type(exc).__name__}: {exc}"
        with lock:
            arm.status, arm.error, arm.seconds = status, error, time.perf_counter() - t0
            finished[0] += 1
            print(f"[{finished[0]:2d}/{total}] {arm.name}: {status} in {arm.seconds:.0f}s "
                  f"(t = {time.perf_counter() - start:.0f}s){'  ' + error if error else ''}", file=sys.stderr,
                  flush=True)
            lock.notify_all()

    with lock:
        while True:
            for arm in arms.values():  # skip what can no longer run
                if arm.status == "pending" and any(arms[d].status in ("failed", "skipped") for d in arm.deps):
                    arm.status, arm.error = "skipped", "a dependency failed"
                    finished[0] += 1
            running = sum(a.status == "running" for a in arms.values())
            ready = sorted((a for a in arms.values() if a.status == "pending"
                            and all(arms[d].status == "done" for d in a.deps)), key=lambda a: -chain_cost(a.name))
            for arm in ready[:max(0, jobs - running)]:
                arm.status = "running"
                threading.Thread(target=work, args=(arm,), daemon=True).start()
                running += 1
            if running == 0 and not ready:
                break
            lock.wait()
