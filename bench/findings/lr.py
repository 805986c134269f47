"""Finding 2, the learning rate: the quickstart recipe at lr 1e-6 / 1e-5 / 1e-4 / 1e-3 and equal
steps; KL to the reference, grad norm, held-out gain, and what ``rltt review`` diagnoses."""

from __future__ import annotations

from pathlib import Path

from .metrics import aggregate, review_run, rl_summary
from .runner import Arm, Scale, done_arms, train_arm

LRS = (1e-6, 1e-5, 1e-4, 1e-3)


def lr_arms(out: Path, scale: Scale) -> dict[str, Arm]:
    arms = {}
    for lr in LRS:
        for seed in range(scale.lr_seeds):
            name = f"lr-{lr:.0e}-s{seed}"
            arms[name] = train_arm(out, scale, name, seed, scale.lr_steps, [f"learner.lr={lr:g}"],
                                   cost=scale.lr_steps / 60 * 4)
    return arms


def lr_results(arms: dict[str, Arm], scale: Scale) -> dict:
    res = {}
    for lr in LRS:
        done = done_arms(arms, f"lr-{lr:.0e}-s")
        runs = [rl_summary(a.run_dir) for a in done]
        reviews = [review_run(a.run_dir) for a in done]
        res[f"{lr:g}"] = {"lr": lr, "runs": runs, "reviews": reviews, **aggregate(runs, scale.n_eval)}
    return res
