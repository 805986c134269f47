"""Finding 4, per-loop credit: ``algorithm.policy_logprob`` = exit / final / rltt (omega exit_pdf
and progressive) at equal steps and seeds, with sampled exits (``rollout.exit_policy=sample``;
under the quickstart's own ``final`` exits, exit and final are the same log-prob); held-out gain
and the exit distribution after RL."""

from __future__ import annotations

from pathlib import Path

from .metrics import aggregate, diff_verdict, rl_summary
from .runner import Arm, Scale, done_arms, train_arm

#: per-loop credit arms: name -> algorithm overrides
CREDIT = {
    "exit": ["algorithm.policy_logprob=exit"],
    "final": ["algorithm.policy_logprob=final"],
    "rltt-exit_pdf": ["algorithm.policy_logprob=rltt", "algorithm.omega=exit_pdf"],
    "rltt-progressive": ["algorithm.policy_logprob=rltt", "algorithm.omega=progressive"],
}
CREDIT_ROLLOUT = ["rollout.exit_policy=sample"]


def credit_arms(out: Path, scale: Scale) -> dict[str, Arm]:
    arms = {}
    for kind, overrides in CREDIT.items():
        for seed in range(scale.credit_seeds):
            name = f"credit-{kind}-s{seed}"
            arms[name] = train_arm(out, scale, name, seed, scale.rl_steps, [*CREDIT_ROLLOUT, *overrides],
                                   cost=scale.rl_steps / 60 * (5 if kind.startswith("rltt") else 4))
    return arms


def credit_results(arms: dict[str, Arm], scale: Scale) -> dict:
    res = {}
    for kind in CREDIT:
        runs = [rl_summary(a.run_dir) for a in done_arms(arms, f"credit-{kind}-s")]
        res[kind] = {"runs": runs, **aggregate(runs, scale.n_eval)}
    res["rltt_vs_final"] = {k: diff_verdict(res[k], res["final"], k, "final")
                            for k in ("rltt-exit_pdf", "rltt-progressive")}
    res["exit_vs_final"] = diff_verdict(res["exit"], res["final"], "exit", "final")
    return res
