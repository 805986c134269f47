"""Asynchronous RL: steps per minute at ``orchestration.max_staleness`` K = 0, 1, 2, 4 (and with
``orchestration.partial_rollouts`` where the code has it), against K = 0 in the same process.

    python bench/async.py                          # quickstart and quickstart-longtail, 8 steps each (~10 min)
    python bench/async.py --steps 6 --recipes quickstart --ks 0,2
    python bench/async.py --lengths 8              # completion lengths of 8 steps' rows, before training (~1 min)

Setup. ``orchestration.backend=ray`` with one rollout worker and one learner, each reserving one
CPU (``orchestration.ray.num_cpus=1``: torch runs one thread in each actor) on a local cluster
started here with two logical CPUs per configuration, so every configuration's actors are
placed at once. The driver (this process) scores rewards and computes advantages. For each recipe
(``recipes/quickstart.yaml`` and ``recipes/quickstart-longtail.yaml``, the cached quickstart
model; no evaluation, checkpoints or review) the configurations' trainers are built side by
side and take their steps interleaved — step 1 of each, then step 2 of each, the order rotating
every step — so load from other jobs on a shared machine hits every configuration alike. The
recipes' ``train.steps`` is left far beyond the steps taken, so no configuration runs the end of
its pipeline (where nothing is left to sample ahead) inside the measurement.

Figures. A step is the wall time of ``train_step`` as the driver sees it (its rollout or the
wait for rows sampled ahead, rewards, the update with the sampling ahead it overlaps, the weight
sync). Steps per minute: 60 × (N − 1) / the summed wall time of steps 2..N (step 1 fills the
pipeline: it samples steps 2 … 1 + K during its update). ``learner idle`` / ``rollout idle``:
the mean over steps 2..N of ``orchestration/learner_idle_frac`` / ``rollout_idle_frac``;
``rows dropped``: ``orchestration/dropped_rows`` summed (partial rollouts: rows of groups more than
K versions behind, never trained on); ``staleness``: the mean of ``orchestration/staleness``. ``length max/mean``: completion tokens of the steps' rows (the long tail).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"quickstart": ROOT / "recipes" / "quickstart.yaml",
           "quickstart-longtail": ROOT / "recipes" / "quickstart-longtail.yaml"}
RAY = ["orchestration.backend=ray", "orchestration.ray.rollout_workers=1", "orchestration.ray.learners=1",
       "orchestration.ray.num_cpus=1", "orchestration.ray.timeout_s=600"]
FAR = 100_000  # train.steps: the pipeline never reaches its end inside the measurement


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def has_partial() -> bool:
    """Whether this checkout's orchestration section has ``partial_rollouts``."""
    from rltt.orchestration.orchestration_section import OrchestrationSection

    return "partial_rollouts" in {f.name for f in fields(OrchestrationSection)}


def configs(ks: list[int], partial: bool) -> dict[str, list[str]]:
    out = {f"K={k}": [f"orchestration.max_staleness={k}"] for k in ks}
    if partial:
        out.update({f"K={k}+partial": [f"orchestration.max_staleness={k}", "orchestration.partial_rollouts=true"]
                    for k in ks if k >= 1})
    return out


def make_trainer(recipe: Path, overrides: list[str], run_dir: Path, args):
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.orchestration.trainer import Trainer

    common = [f"model.path={args.model}", f"train.steps={FAR}", "train.eval_every=0", "checkpoint.every=0",
              "checkpoint.save_final=false", "logging.review_at_end=false", "logging.review_every=0",
              "logging.progress=false", f"logging.run_dir={run_dir}", *RAY, *overrides, *args.set]
    return Trainer(load_train_recipe(recipe, common), recipe_root=ROOT)


def measure(name: str, recipe: Path, table: dict[str, list[str]], args, out: Path) -> dict:
    from rltt.telemetry import schema as m

    trainers, rows = {}, {c: [] for c in table}
    try:
        for config, overrides in table.items():
            t0 = time.perf_counter()
            trainers[config] = make_trainer(recipe, overrides, out / name / config.replace("=", "").replace("+", "-"),
                                            args)
            print(f"[async] {name}: built {config} in {time.perf_counter() - t0:.1f} s", flush=True)
        names = list(table)
        load_before = load()
        for step in range(1, args.steps + 1):
            order = names[step % len(names):] + names[:step % len(names)]
            for config in order:
                tr = trainers[config]
                t0 = time.perf_counter()
                metrics = tr.train_step(step)
                wall = time.perf_counter() - t0
                tr.step = step
                tr.logger.log(step, metrics)
                rows[config].append({"wall": wall, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}})
            print(f"[async] {name} step {step}: " + ", ".join(f"{c} {rows[c][-1]['wall']:.2f} s" for c in names)
                  + f" (load {load()})", flush=True)
        load_after = load()
    finally:
        for tr in trainers.values():
            if tr.logger is not None:
                tr.logger.close()
            tr.close()

    def mean(config, key):
        values = [r[key] for r in rows[config][1:] if key in r]
        return statistics.fmean(values) if values else None

    result = {"load": f"{load_before} -> {load_after}", "configs": {}}
    for config in table:
        steady = rows[config][1:]
        rate = 60.0 * len(steady) / sum(r["wall"] for r in steady)
        result["configs"][config] = {
            "rate": rate, "walls": [round(r["wall"], 2) for r in rows[config]],
            "learner_idle": mean(config, m.ORCH_LEARNER_IDLE_FRAC), "rollout_idle": mean(config, m.ORCH_ROLLOUT_IDLE_FRAC),
            "dropped": sum(r.get(m.ORCH_DROPPED_ROWS, 0) for r in rows[config]),
            "staleness": mean(config, m.ORCH_STALENESS), "length_mean": mean(config, m.LENGTH_MEAN),
            "length_max": max(r.get(m.LENGTH_MAX, 0) for r in rows[config])}
    base = result["configs"].get("K=0")
    for c in result["configs"].values():
        c["ratio"] = c["rate"] / base["rate"] if base else float("nan")
    return result


def lengths(name: str, recipe: Path, steps: int, args, out: Path) -> str:
    """The completion lengths of ``steps`` steps' rollouts (the recipe's rows, sampling seeds and
    prompts) at the model's weights before any update: one process, no Ray."""
    import torch

    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.orchestration.trainer import Trainer

    overrides = [f"model.path={args.model}", "train.eval_every=0", "logging.review_at_end=false",
                 "logging.progress=false", f"logging.run_dir={out / ('lengths-' + name)}",
                 "orchestration.backend=local", "orchestration.max_staleness=0", *args.set]
    trainer = Trainer(load_train_recipe(recipe, overrides), recipe_root=ROOT)
    cap = trainer.recipe.rollout.max_new_tokens
    try:
        got = torch.cat([trainer.training.rollout(step)[0].batch.target_mask.sum(1) for step in range(1, steps + 1)])
    finally:
        trainer.close()
    x = got.double()
    q = torch.quantile(x, torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64)).tolist()
    return (f"| {name} | {cap} | {len(x)} | {x.mean():.1f} | {q[0]:.0f} | {q[1]:.1f} | {q[2]:.0f} | {x.max():.0f} | "
            f"{100 * (x > 48).double().mean():.1f} % | {100 * (x >= cap).double().mean():.1f} % |")


def fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def report(results: dict, args, partial: bool) -> str:
    lines = [f"`python bench/async.py --steps {args.steps} --recipes {','.join(args.recipes)} "
             f"--ks {','.join(map(str, args.ks))}` ({'with' if partial else 'without'} "
             f"orchestration.partial_rollouts; steps per minute over steps 2..{args.steps})", "",
             "| recipe | configuration | steps/min | vs K=0 | learner idle | rollout idle | staleness | "
             "rows dropped | length mean / max | load before -> after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        for config, c in res["configs"].items():
            lines.append(f"| {name} | {config} | {c['rate']:.1f} | {c['ratio']:.2f}x | {fmt(c['learner_idle'])} | "
                         f"{fmt(c['rollout_idle'])} | {fmt(c['staleness'], '.1f')} | {c['dropped']} | "
                         f"{fmt(c['length_mean'], '.1f')} / {c['length_max']:.0f} | {res['load']} |")
    lines.append("")
    q = results.get("quickstart", {}).get("configs", {})
    if "K=1" in q and "K=2" in q:
        lines.append(f"- quickstart: K=2 / K=1 = {q['K=2']['rate'] / q['K=1']['rate']:.2f}x")
    t = results.get("quickstart-longtail", {}).get("configs", {})
    if "K=1" in t and "K=2+partial" in t:
        lines.append(f"- quickstart-longtail: (K=2 + partial rollouts) / (K=1 without) = "
                     f"{t['K=2+partial']['rate'] / t['K=1']['rate']:.2f}x")
    elif "K=1" in t and "K=2" in t:
        lines.append(f"- quickstart-longtail: K=2 / K=1 = {t['K=2']['rate'] / t['K=1']['rate']:.2f}x "
                     f"(partial rollouts not measured)")
    for name, res in results.items():
        for config, c in res["configs"].items():
            lines.append(f"- {name} {config} step seconds: {c['walls']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="steps per configuration (the first fills the pipeline)")
    p.add_argument("--recipes", type=lambda s: s.split(","), default=list(RECIPES),
                   help=f"comma-separated: {', '.join(RECIPES)}")
    p.add_argument("--ks", type=lambda s: [int(k) for k in s.split(",")], default=[0, 1, 2, 4])
    p.add_argument("--partial", choices=("auto", "off"), default="auto",
                   help="auto: also K >= 1 with orchestration.partial_rollouts when the code has it")
    p.add_argument("--model", default="quickstart")
    p.add_argument("--set", nargs="*", default=[], help="extra recipe overrides for every configuration")
    p.add_argument("--lengths", type=int, default=0, metavar="STEPS",
                   help="only: the completion lengths of STEPS steps' rows before training, per recipe")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (step 1 fills the pipeline)")
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        p.error(f"--recipes: unknown {unknown} (choose from {', '.join(RECIPES)})")

    if args.lengths:
        print(f"`python bench/async.py --lengths {args.lengths} --recipes {','.join(args.recipes)}`\n")
        print("| recipe | max_new_tokens | rows | mean | median | p95 | p99 | max | > 48 tokens | at the cap |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        with tempfile.TemporaryDirectory(prefix="rltt-bench-async-") as tmp:
            for name in args.recipes:
                print(lengths(name, RECIPES[name], args.lengths, args, Path(tmp)), flush=True)
        return 0

    import ray

    from rltt.orchestration.ray.cluster import ZERO_COPY, actor_env

    partial = args.partial == "auto" and has_partial()
    table = configs(args.ks, partial)
    os.environ.update(ZERO_COPY)
    ray.init(address="local", num_cpus=2 * len(table), include_dashboard=False, object_store_memory=512 * 1024**2,
             log_to_driver=False, runtime_env={"env_vars": actor_env(1)})
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="rltt-bench-async-") as tmp:
            for name in args.recipes:
                results[name] = measure(name, RECIPES[name], table, args, Path(tmp))
    finally:
        ray.shutdown()
    print(report(results, args, partial))
    return 0


if __name__ == "__main__":
    sys.exit(main())
