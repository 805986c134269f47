"""Finding 4, per-loop credit: ``algorithm.policy_logprob`` = exit / final / rltt (omega exit_pdf
and progressive) at equal steps and seeds, with sampled exits (``rollout.exit_policy=sample``;
under the quickstart's own ``final`` exits, exit and final are the same log-prob); held-out gain
and the exit distribution after RL, and each arm's final checkpoint evaluated with ``rltt eval
--out`` so that every arm is compared with ``final`` by `rltt.evaluation`: pass@1 pooled over its
seeds (two-level bootstrap over problems and seeds), the difference with its 95 % interval and a
run-permutation p-value (paired over the same held-out problems)."""

from __future__ import annotations

from pathlib import Path

from .metrics import aggregate, diff_verdict, rl_summary
from .runner import RL_RECIPE, Arm, Scale, done_arms, rel, train_argv

#: per-loop credit arms: name -> algorithm overrides
CREDIT = {
    "exit": ["algorithm.policy_logprob=exit"],
    "final": ["algorithm.policy_logprob=final"],
    "rltt-exit_pdf": ["algorithm.policy_logprob=rltt", "algorithm.omega=exit_pdf"],
    "rltt-progressive": ["algorithm.policy_logprob=rltt", "algorithm.omega=progressive"],
}
CREDIT_ROLLOUT = ["rollout.exit_policy=sample"]
#: the arm every other is compared with
BASELINE = "final"
EVAL_FILE = "eval.json"


def credit_kinds(scale: Scale) -> list[str]:
    """The credit arms this scale runs (``--credit-arms``; all of `CREDIT` by default), in table order."""
    return [k for k in CREDIT if not scale.credit_arms or k in scale.credit_arms]


def eval_file(run_dir: Path) -> Path:
    return run_dir / EVAL_FILE


def credit_arms(out: Path, scale: Scale) -> dict[str, Arm]:
    """Per kind and seed: the RL run (its final checkpoint kept) and ``rltt eval`` of that checkpoint
    (the same held-out problems and evaluation seed for every arm)."""
    arms = {}
    for kind in credit_kinds(scale):
        for seed in range(scale.credit_seeds):
            name = f"credit-{kind}-s{seed}"
            run = out / "runs" / name
            recipe = [*CREDIT_ROLLOUT, *CREDIT[kind]]
            train = train_argv(scale, run, seed, scale.rl_steps, recipe, keep_final=True)
            arms[name] = Arm(name, train, cost=scale.rl_steps / 60 * (5 if kind.startswith("rltt") else 4),
                             run_dir=run)
            final = run / "checkpoints" / f"step-{scale.rl_steps:07d}"
            evaluate = ["eval", RL_RECIPE, *recipe, f"data.eval_size={scale.eval_size}",
                        "--model", rel(final), "--samples", str(scale.eval_samples), "--out", rel(eval_file(run)),
                        "--bootstrap", "100"]
            arms[f"{name}-eval"] = Arm(f"{name}-eval", evaluate, deps=(name,), cost=0.5)
    return arms


def credit_results(arms: dict[str, Arm], scale: Scale) -> dict:
    """Per kind: the seeds' summaries, their mean gain (`aggregate`) and pass@1 of the final
    checkpoints pooled over seeds; per kind but `BASELINE`: the gain difference in binomial SEs
    (`diff_verdict`) and the paired difference of the final checkpoints' pass@1 (``vs_final``)."""
    from rltt.errors import RlttError
    from rltt.evaluation.results import compare_object, pool_object

    kinds = credit_kinds(scale)
    res: dict = {"kinds": kinds}
    files: dict[str, str] = {}
    for kind in kinds:
        trained = done_arms(arms, f"credit-{kind}-s")
        runs = [rl_summary(a.run_dir) for a in trained if not a.name.endswith("-eval")]
        res[kind] = {"runs": runs, **aggregate(runs, scale.n_eval)}
        evaluated = [eval_file(a.run_dir) for a in trained if a.run_dir is not None and eval_file(a.run_dir).is_file()]
        files[kind] = ",".join(str(f) for f in evaluated)
        if evaluated:
            res[kind]["eval_seeds"] = len(evaluated)
            res[kind]["pass1"] = pool_object(files[kind])["summary"]["pass@1"]
    if BASELINE in kinds:
        res["vs_final"] = {}
        for kind in kinds:
            if kind == BASELINE:
                continue
            res[kind]["gain_vs_final"] = diff_verdict(res[kind], res[BASELINE], kind, BASELINE)
            if files[kind] and files[BASELINE]:
                try:
                    res["vs_final"][kind] = compare_object(files[kind], files[BASELINE])["difference"]["pass@1"]
                except RlttError as exc:
                    res["vs_final"][kind] = {"error": str(exc)}
    return res
