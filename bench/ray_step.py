"""Ray orchestration: RL step time against the local loop at the same work, and weight-sync cost.

    python bench/ray_step.py                     # 8 steps of recipes/quickstart.yaml per configuration (~4 min)
    python bench/ray_step.py --write             # ... and update bench/RESULTS.md's section

Step time. The same recipe (``recipes/quickstart.yaml``, the cached quickstart model; no
evaluation, checkpoints or review) runs in four trainers built side by side in one process:
the local loop (`Trainer`: engine and learner in this process, sharing the model's
tensors), and `Trainer` (``orchestration.backend=ray``: the driver here, a learner actor and
the rollout-worker actors) with 1 and 2 rollout workers, and with 1 worker and
``orchestration.overlap=1`` (step k+1's rollouts sampled while step k learns). The trainers
take their steps interleaved — step 1 of each, then step 2 of each, the order rotating every
step — so load from other jobs on a shared machine hits every configuration alike. A step's
time is the wall time of ``train_step`` (rollouts, rewards, advantages, the update, the weight
sync; the driver's view, so it includes every object-store transfer), the figure the median
over steps 2..N. Generating and updating are also timed where they ran (`Inside`: the local
process; a Ray run's rollout workers and learner ranks report their own seconds), so a phase's
time minus its work is what orchestration adds (transfers, calls, scheduling), reported apart
from the work the actors do (which a shared machine's load moves by ±20 % step to step).
"Same rewards" checks that a configuration sampled exactly the local loop's
rollouts (per-step mean reward equal; rollouts are keyed by prompt index, so they must be,
except with overlap, which trains on rollouts one version old).

Weight sync. The object-store path of a Ray run, timed as the training step times it
(``time/weight_sync``): a source actor returns ``(version, tensors)`` the way a learner
rank's ``rollout_state_dict`` does (the tensors go into the object store once), and a
`RayRolloutPool` of 1 or 2 rollout workers (each a `NativeEngine` on a random LoopLM of that
size) loads them (``ray.get`` then a copy into the engine's parameters). Ray reads torch
tensors in place (``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``, set by `rltt.orchestration.ray`).
Median of ``--sync-repeats`` syncs after one warm-up, in ms and ms per MB of fp32 weights.

Ray actors run torch with one thread (``orchestration.ray.num_cpus=0``), as the local loop does
with the recipe's ``train.threads=1``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Ray orchestration (bench/ray_step.py)"
RECIPE = ROOT / "recipes" / "quickstart.yaml"

CONFIGS = {
    "local": [],
    "ray-1": ["orchestration.backend=ray", "orchestration.ray.rollout_workers=1"],
    "ray-2": ["orchestration.backend=ray", "orchestration.ray.rollout_workers=2"],
    "ray-1-overlap": ["orchestration.backend=ray", "orchestration.ray.rollout_workers=1", "orchestration.overlap=1"],
}
LABELS = {"local": "local loop", "ray-1": "Ray, 1 rollout worker", "ray-2": "Ray, 2 rollout workers",
          "ray-1-overlap": "Ray, 1 rollout worker, overlap=1"}


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


# -- step time -------------------------------------------------------------------------------------
def make_trainer(name: str, args, out: Path):
    from rltt.orchestration.train_recipe import load_train_recipe

    overrides = [f"model.path={args.model}", f"train.steps={args.steps}", "train.eval_every=0",
                 "checkpoint.every=0", "checkpoint.save_final=false", "logging.review_at_end=false",
                 "logging.review_every=0", "logging.progress=false",
                 f"logging.run_dir={out / name}", *CONFIGS[name], *args.set]
    recipe = load_train_recipe(RECIPE, overrides)
    from rltt.orchestration.trainer import Trainer

    return Trainer(recipe, recipe_root=ROOT)  # its orchestration (local or Ray) from the recipe


class Inside:
    """Seconds a trainer's engine spent generating and its learner updating, counted where the
    work ran: the local loop's own calls; a Ray run's rollout workers (`RayRolloutPool.worker_s`,
    the slowest shard of each call) and learner ranks (the slowest rank of each update). A
    phase's time minus these is what orchestration adds (transfers, calls, scheduling)."""

    def __init__(self, trainer):
        self.trainer, self.update_s, self.local_generate_s = trainer, 0.0, 0.0
        learner = trainer.learner
        if hasattr(trainer.engine, "worker_s"):  # Ray: the actors report their own seconds
            finish = learner.finish_update

            def finish_update(refs):
                metrics, seconds = finish(refs)
                self.update_s += seconds
                return metrics, seconds

            learner.finish_update = finish_update
        else:
            engine, update = trainer.engine, learner.update

            def generate(*a, **k):
                t0 = time.perf_counter()
                try:
                    return type(engine).generate(engine, *a, **k)
                finally:
                    self.local_generate_s += time.perf_counter() - t0

            def timed_update(batch):
                t0 = time.perf_counter()
                try:
                    return update(batch)
                finally:
                    self.update_s += time.perf_counter() - t0

            engine.generate, learner.update = generate, timed_update

    @property
    def generate_s(self) -> float:
        return getattr(self.trainer.engine, "worker_s", self.local_generate_s)


def step_times(args, out: Path) -> dict:
    from rltt.telemetry import schema as m

    names = [n for n in CONFIGS if n in args.configs]
    trainers, inside = {}, {}
    try:
        for name in names:
            t0 = time.perf_counter()
            trainers[name] = make_trainer(name, args, out)
            inside[name] = Inside(trainers[name])
            print(f"[ray_step] built {name} in {time.perf_counter() - t0:.1f} s", flush=True)
        rows: dict[str, list[dict]] = {n: [] for n in names}
        load_before = load()
        for step in range(1, args.steps + 1):
            order = names[step % len(names):] + names[:step % len(names)]
            for name in order:
                tr, work = trainers[name], inside[name]
                before = work.generate_s, work.update_s
                t0 = time.perf_counter()
                metrics = tr.train_step(step)
                wall = time.perf_counter() - t0
                tr.step = step
                tr.logger.log(step, metrics)
                row = {"wall": wall, "generate": work.generate_s - before[0], "update": work.update_s - before[1],
                       **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
                if not tr.recipe.orchestration.staleness:  # with overlap the update phase also samples ahead
                    row["rollout_extra"] = row[m.TIME_ROLLOUT] - row["generate"]
                    row["learner_extra"] = row[m.TIME_LEARNER] - row["update"]
                rows[name].append(row)
            print(f"[ray_step] step {step}: " + ", ".join(f"{n} {rows[n][-1]['wall']:.2f} s" for n in names)
                  + f" (load {load()})", flush=True)
        load_after = load()
        model_bytes, transport = 0, None
        if "local" in trainers:
            _, tensors = trainers["local"].learner.rollout_state_dict()
            model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            transport = batch_transport(trainers["local"], args.steps + 1)
    finally:
        for tr in trainers.values():
            if tr.logger is not None:
                tr.logger.close()
            tr.close()

    skip = min(1, args.steps - 1)

    def med(name, key):
        values = [r[key] for r in rows[name][skip:] if key in r]
        return statistics.median(values) if values else float("nan")

    base = rows.get("local")
    result = {"steps": args.steps, "load_before": load_before, "load_after": load_after, "model_bytes": model_bytes,
              "transport": transport, "configs": {}}
    for name in names:
        same = None
        if base is not None:
            same = all(a[m.REWARD_MEAN] == b[m.REWARD_MEAN] for a, b in zip(rows[name], base))
        result["configs"][name] = {
            "step": med(name, "wall"), "rollout": med(name, m.TIME_ROLLOUT), "learner": med(name, m.TIME_LEARNER),
            "generate": med(name, "generate"), "update": med(name, "update"),
            "rollout_extra": med(name, "rollout_extra"), "learner_extra": med(name, "learner_extra"),
            "sync": med(name, m.TIME_WEIGHT_SYNC), "saved": med(name, m.ORCH_OVERLAP_SAVED_S),
            "staleness": med(name, m.ORCH_STALENESS), "same": same,
            "rewards": [r[m.REWARD_MEAN] for r in rows[name]], "walls": [r["wall"] for r in rows[name]]}
    local = result["configs"].get("local")
    for name, c in result["configs"].items():
        c["ratio"] = c["step"] / local["step"] if local else float("nan")
    return result


def batch_transport(trainer, step: int, repeats: int = 5) -> list[dict]:
    """Pickled size and pickle / unpickle ms (``ray.cloudpickle``, protocol 5, median of
    ``repeats``) of one step's `RolloutBatch` as a rollout worker returns it, of its schedule,
    and of the schedule's passes pickled one by one (the per-record form)."""
    import pickle

    from ray import cloudpickle

    tasks = trainer.prompts.next(trainer.recipe.rollout.prompts_per_step)
    batch = trainer.engine.generate([t.prompt_ids for t in tasks],
                                    trainer.training.sampling(step, 0, range(len(tasks))))
    rows = []
    for what, obj in (("rollout batch", batch), ("its schedule", batch.schedule),
                      (f"its {len(batch.schedule.passes)} passes one by one", list(batch.schedule.passes))):
        dumps, loads = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            data = cloudpickle.dumps(obj, protocol=5)
            t1 = time.perf_counter()
            pickle.loads(data)
            dumps.append(t1 - t0)
            loads.append(time.perf_counter() - t1)
        rows.append({"what": what, "mb": len(data) / 1e6, "dump_ms": 1000 * statistics.median(dumps),
                     "load_ms": 1000 * statistics.median(loads)})
    return rows


def transport_table(rows: list[dict]) -> str:
    lines = ["| object | pickled MB | pickle ms | unpickle ms |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['mb']:.3f} | {r['dump_ms']:.1f} | {r['load_ms']:.1f} |")
    return "\n".join(lines)


def step_table(res: dict) -> str:
    lines = ["| configuration | step s (median) | × local | rollout s | of it generating s | learner s | "
             "of it updating s | weight sync ms | overlap saved s | staleness | same rewards as local |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]

    def num(value, fmt="{:.3f}"):
        return "—" if value != value else fmt.format(value)

    for name, c in res["configs"].items():
        same = "—" if name == "local" or c["same"] is None else ("yes" if c["same"] else "no")
        lines.append(f"| {LABELS[name]} | {c['step']:.3f} | **{c['ratio']:.2f}×** | {c['rollout']:.3f} | "
                     f"{num(c['generate'])} | {c['learner']:.3f} | {num(c['update'])} | {1000 * c['sync']:.1f} | "
                     f"{num(c['saved'], '{:.2f}')} | {num(c['staleness'], '{:g}')} | {same} |")
    return "\n".join(lines)


def overhead_table(res: dict) -> str:
    """What orchestration adds to a step beyond the work (medians of per-step differences)."""
    lines = ["| configuration | rollout phase − generating ms | update phase − updating ms | weight sync ms |",
             "|---|---:|---:|---:|"]
    for name, c in res["configs"].items():
        if c["rollout_extra"] == c["rollout_extra"]:
            lines.append(f"| {LABELS[name]} | {1000 * c['rollout_extra']:.1f} | {1000 * c['learner_extra']:.1f} | "
                         f"{1000 * c['sync']:.1f} |")
    return "\n".join(lines)


# -- weight sync -----------------------------------------------------------------------------------
@dataclass
class RandomEngine:
    """A rollout worker's engine: a `NativeEngine` on a random LoopLM (hidden ``hidden``)."""

    hidden: int
    layers: int = 2
    vocab: int = 4096

    def model(self, seed: int):
        from rltt.model import LoopConfig, LoopedForCausalLM

        torch.manual_seed(seed)
        cfg = LoopConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=3 * self.hidden,
                         num_hidden_layers=self.layers, num_attention_heads=8, num_key_value_heads=2, num_loops=4,
                         max_position_embeddings=256)
        return LoopedForCausalLM(cfg).eval()

    def __call__(self):
        from rltt.rollout import NativeEngine

        return NativeEngine(self.model(0))


class WeightSource:
    """Stands in for learner rank 0: returns ``(version, tensors)`` as its ``rollout_state_dict`` does."""

    def __init__(self, spec: RandomEngine):
        torch.set_num_threads(1)
        self.tensors = {k: v.detach() for k, v in spec.model(1).state_dict().items()}
        self.version = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def rollout_state_dict(self):
        self.version += 1
        return self.version, self.tensors


def sync_times(args) -> list[dict]:
    import ray

    from rltt.orchestration.ray.cluster import actor_env
    from rltt.orchestration.orchestration_section import RaySection
    from rltt.orchestration.ray.rollout_pool import RayRolloutPool, RemoteTensors

    cfg = RaySection()
    rows = []
    for hidden in args.sync_hidden:
        spec = RandomEngine(hidden)
        source = ray.remote(WeightSource).options(num_cpus=0, runtime_env={"env_vars": actor_env(1)}).remote(spec)
        nbytes = ray.get(source.nbytes.remote(), timeout=cfg.timeout_s)
        for workers in args.sync_workers:
            pool = RayRolloutPool(spec, cfg, workers=workers)
            try:
                times = []
                for rep in range(args.sync_repeats + 1):
                    t0 = time.perf_counter()
                    version_ref, tensors_ref = source.rollout_state_dict.options(num_returns=2).remote()
                    version = ray.get(version_ref, timeout=cfg.timeout_s)
                    ray.wait([tensors_ref], timeout=cfg.timeout_s)
                    pool.load_weights(version, RemoteTensors(tensors_ref, cfg.timeout_s))
                    if rep:  # the first one is a warm-up
                        times.append(time.perf_counter() - t0)
                served = {info["version"] for info in pool.worker_infos()}
                if served != {version}:
                    raise RuntimeError(f"workers serve versions {served}, expected {version}")
            finally:
                pool.close()
            ms = 1000 * statistics.median(times)
            mb = nbytes / 1e6
            rows.append({"hidden": hidden, "workers": workers, "mb": mb, "ms": ms, "ms_per_mb": ms / mb,
                         "min_ms": 1000 * min(times), "load": load()})
            print(f"[ray_step] sync {mb:.1f} MB to {workers} worker(s): {ms:.1f} ms ({ms / mb:.2f} ms/MB)", flush=True)
        ray.kill(source)
    return rows


def sync_table(rows: list[dict]) -> str:
    lines = ["| weights (fp32) | rollout workers | sync ms (median) | min ms | ms per MB | load avg (1/5/15 min) |",
             "|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['mb']:.1f} MB (d={r['hidden']}) | {r['workers']} | {r['ms']:.1f} | {r['min_ms']:.1f} | "
                     f"**{r['ms_per_mb']:.2f}** | {r['load']} |")
    return "\n".join(lines)


def write_section(body: str, path: Path = ROOT / "bench" / "RESULTS.md") -> None:
    text = path.read_text() if path.is_file() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    block = f"{SECTION}\n\n{body.strip()}\n"
    text = pattern.sub(lambda _: block + "\n", text, count=1).rstrip() + "\n" if pattern.search(text) \
        else text.rstrip() + "\n\n" + block
    path.write_text(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="quickstart", help="model.path of the runs (default: the quickstart model)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra recipe override")
    p.add_argument("--sync-hidden", type=lambda s: [int(x) for x in s.split(",") if x], default=[128, 512, 1024],
                   help="hidden sizes of the weight-sync models (L=2, V=4096); empty: skip")
    p.add_argument("--sync-workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--sync-repeats", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "runs" / "ray_step"))
    p.add_argument("--write", action="store_true", help="write the tables into bench/RESULTS.md")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    return args


def main(argv=None) -> int:
    import shutil

    import ray

    from rltt.orchestration.ray.cluster import connect, disconnect
    from rltt.orchestration.orchestration_section import RaySection

    args = parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t_start = time.perf_counter()
    started = connect(RaySection())  # one local cluster for every configuration, as `rltt train` starts it
    try:
        steps = step_times(args, out)
        sync = sync_times(args) if args.sync_hidden else []
    finally:
        disconnect(started)
    command = "python bench/ray_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    body = [f"Command: `{command.strip()}` (ray {ray.__version__}; total {time.perf_counter() - t_start:.0f} s)", "",
            f"Step time, {steps['steps']} steps of recipes/quickstart.yaml per configuration (interleaved; median "
            f"over steps 2..{steps['steps']}; load average 1/5/15 min {steps['load_before']} before, "
            f"{steps['load_after']} after; the model's rollout weights: {steps['model_bytes'] / 1e6:.2f} MB):", "",
            step_table(steps), "",
            "Generating and updating are timed where they ran (the local process; the rollout worker and the "
            "learner actor of a Ray run); a phase's time minus that work is what orchestration adds "
            "(object-store transfers, calls, scheduling; the local loop's is scoring and batching):", "",
            overhead_table(steps)]
    if steps["transport"]:
        body += ["", "What a rollout worker returns per step (one step's rollout batch, pickled with ray.cloudpickle, protocol 5; "
                 "the schedule travels as a few flat tensors, its passes rebuilt on load):", "",
                 transport_table(steps["transport"])]
    if sync:
        body += ["", "Weight sync through the object store (source actor → rollout workers, zero-copy tensors):", "",
                 sync_table(sync)]
    text = "\n".join(body)
    print(text)
    if args.write:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
