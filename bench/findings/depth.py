"""Finding 5, depth: the dense twin again on a depth-hungry task. ``recipes/pretrain-tiny.yaml``
on the multi-hop lookups of `rltt.data.chains` (``synthetic:chains``: 1–4 hops, answer only) at
T = 4 and at T = 1 (the same block and data), then equal RL steps of the quickstart recipe on the
same task from each; every model (after pretraining, after RL) is evaluated on held-out problems
of each hop count with ``rltt eval --out``, and T = 4 is compared with T = 1 per hop count with
`rltt.evaluation` (paired over the same problems: difference, 95 % interval, p-value)."""

from __future__ import annotations

import json
from pathlib import Path

from .metrics import paired_pass1, read_records, series
from .runner import Arm, Scale, T, eval_arm, final_checkpoint, rel, train_argv

PRETRAIN_RECIPE = "recipes/pretrain-tiny.yaml"
#: the default task (``--depth-source``): 1–4 hops mixed
SOURCE = "synthetic:chains"


def hop_counts(source: str) -> tuple[int, ...]:
    """The hop counts a ``synthetic:chains...`` source mixes (its difficulty's ``hop_range``)."""
    from rltt.data.synthetic import resolve_difficulty

    lo, hi = resolve_difficulty(source.partition(":")[2]).hop_range
    return tuple(range(lo, hi + 1))


def eval_file(out: Path, model: str, hops: int | None = None) -> Path:
    """``rltt eval --out`` of ``model`` (mixed hop counts), or its problems of ``hops`` hops."""
    return out / "depth" / (f"{model}.json" if hops is None else f"{model}-h{hops}.json")


def depth_eval(out: Path, scale: Scale, model: str, checkpoint: Path, dep: str) -> Arm:
    """``rltt eval`` of ``checkpoint`` on held-out ``synthetic:chains`` problems (every hop count)."""
    return eval_arm(f"depth-eval-{model}", checkpoint, eval_file(out, model), scale.eval_samples, (dep,),
                    overrides=(f"data.source={scale.depth_source}",),
                    flags=("--source", scale.depth_source, "--limit", str(scale.depth_eval_size)))


def hops_of(problem_id: str, source: str = SOURCE) -> int:
    """The hop count of held-out problem ``chains-SEED-INDEX`` of ``source`` (regenerated)."""
    from rltt.data.synthetic import resolve_difficulty

    _, seed, index = problem_id.rsplit("-", 2)
    return resolve_difficulty(source.partition(":")[2]).problem(int(index), int(seed)).hops


def split_by_hops(path: Path, source: str = SOURCE) -> dict[int, Path]:
    """Write the problems of an eval result with each hop count to their own result file."""
    obj = json.loads(path.read_text())
    hops = {r["id"]: hops_of(r["id"], source) for r in obj["problems"]}  # each problem regenerated once
    files = {}
    for count in hop_counts(source):
        rows = [r for r in obj["problems"] if hops[r["id"]] == count]
        if rows:
            files[count] = path.with_name(f"{path.stem}-h{count}.json")
            files[count].write_text(json.dumps({"format": obj.get("format"), "problems": rows}))
    return files


def depth_arms(out: Path, scale: Scale) -> dict[str, Arm]:
    arms: dict[str, Arm] = {}
    (out / "depth").mkdir(parents=True, exist_ok=True)
    for loops in (T, 1):
        pre = f"depth-pretrain-T{loops}"
        run = out / "runs" / pre
        arms[pre] = Arm(pre, ["pretrain", PRETRAIN_RECIPE, f"data.source={scale.depth_source}",
                              f"model.config.num_loops={loops}",
                              f"train.steps={scale.depth_pretrain_steps}", f"logging.run_dir={rel(run)}",
                              "logging.progress=false", *scale.depth_pretrain_overrides, *scale.pretrain],
                        cost=(10.0 if loops == T else 3.0) if not scale.pretrain else 1.0, run_dir=run)
        arm = depth_eval(out, scale, f"pre-T{loops}", run / "final", pre)
        arms[arm.name] = arm
        for seed in range(scale.depth_seeds):
            rl = f"depth-rl-T{loops}-s{seed}"
            rl_run = out / "runs" / rl
            argv = train_argv(scale, rl_run, seed, scale.rl_steps, [f"model.path={rel(run / 'final')}",
                                                                     f"data.source={scale.depth_source}"],
                              keep_final=True)  # the evaluations read the final checkpoint
            arms[rl] = Arm(rl, argv, deps=(pre,), cost=scale.rl_steps / 60 * (4 if loops == T else 2), run_dir=rl_run)
            arm = depth_eval(out, scale, f"rl-T{loops}-s{seed}", final_checkpoint(rl_run, scale.rl_steps), rl)
            arms[arm.name] = arm
    return arms


def _pretrain(run_dir: Path) -> dict:
    if not (run_dir / "summary.json").is_file():
        return {}
    summary = json.loads((run_dir / "summary.json").read_text())
    ev = summary.get("eval", {})
    steps, loss = series(read_records(run_dir), "lm/loss")
    return {"lm_loss": ev.get("eval/lm_loss"),
            "lm_loss_per_loop": [ev.get(f"eval/lm_loss_step_{t}") for t in range(1, T + 1)],
            "solve_rate": ev.get("eval/solve_rate"), "train_seconds": summary.get("train_seconds"),
            "loss_curve": [steps, loss]}


def depth_results(out: Path, arms: dict[str, Arm], scale: Scale) -> dict:
    """Per stage (``pre``, ``rl``) and hop count: pass@1 of each model (mean, SE, 95 % interval; RL
    seeds pooled) and the paired T = 4 − T = 1 difference with its interval and p-value."""
    res: dict = {"pretrain": {f"T{L}": _pretrain(out / "runs" / f"depth-pretrain-T{L}") for L in (T, 1)},
                 "source": scale.depth_source, "hops": list(hop_counts(scale.depth_source)), "stages": {}}
    for mixed in (out / "depth").glob("*.json"):
        if not mixed.stem.rsplit("-", 1)[-1].startswith("h"):
            split_by_hops(mixed, scale.depth_source)
    for stage in ("pre", "rl"):
        models = {L: [f"pre-T{L}"] if stage == "pre" else [f"rl-T{L}-s{s}" for s in range(scale.depth_seeds)]
                  for L in (T, 1)}
        res["stages"][stage] = {hops: paired_pass1(*([eval_file(out, m, hops) for m in models[L]] for L in (T, 1)),
                                                   names=(f"T{T}", "T1"))
                                for hops in res["hops"]}
    return res
