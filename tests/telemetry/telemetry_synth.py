"""Synthetic metric logs for the telemetry tests: a healthy RL run and ways to break it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

T_LOOPS = 4
N_LAYERS = 4


def healthy_records(n: int = 60, seed: int = 0, T: int = T_LOOPS,
                    layers: int = N_LAYERS) -> list[dict[str, Any]]:
    """A plausible healthy GRPO run: reward rising, KL growing, gate spread over loops."""
    rng = np.random.default_rng(seed)
    records = []
    exit_p = np.array([0.15, 0.25, 0.3, 0.3][:T]) if T <= 4 else np.full(T, 1 / T)
    exit_p = exit_p / exit_p.sum()
    for i in range(n):
        step = i + 1
        frac = i / max(n - 1, 1)
        noise = lambda scale: float(rng.normal(0.0, scale))  # noqa: E731
        reward = 0.25 + 0.35 * frac + noise(0.02)
        p = exit_p + rng.normal(0, 0.01, T)
        p = np.clip(p, 1e-3, None)
        p = p / p.sum()
        record: dict[str, Any] = {
            "step": step,
            "reward/mean": reward,
            "reward/std": 0.4 + noise(0.01),
            "reward/gsm8k_strict": reward - 0.05,
            "reward/format": 0.9 + noise(0.01),
            "reward/errors": 0,
            "solve_rate": reward,
            "groups/uniform_frac": 0.25 + noise(0.03),
            "kl/ref": 1e-3 + 0.02 * frac + abs(noise(2e-4)),
            "loss/policy": noise(0.02),
            "loss/total": noise(0.02) + 0.001,
            "policy/clip_frac": 0.03 + abs(noise(0.005)),
            "policy/ratio_mean": 1.0 + noise(0.002),
            "policy/ratio_max": 1.25 + abs(noise(0.02)),
            "policy/ratio_min": 0.8 - abs(noise(0.02)),
            "grad_norm/total": 0.6 + noise(0.03),
            "sync/changed_frac": 0.7 + noise(0.02),
            "grad_norm/group/embed": 0.1 + abs(noise(0.01)),
            "grad_norm/group/block": 0.5 + abs(noise(0.02)),
            "grad_norm/group/gate": 0.02 + abs(noise(0.002)),
            "grad_norm/group/lm_head": 0.3 + abs(noise(0.01)),
            "grad_norm/group/norm": 0.01 + abs(noise(0.001)),
            "exit/mean_step": float((np.arange(1, T + 1) * p).sum()),
            "exit/collapse": 0.02,
            "exit/entropy": float(-(p * np.log(p)).sum()),
            "mismatch/max_abs": 2e-3 + abs(noise(3e-4)),
            "mismatch/mean_abs": 1e-4 + abs(noise(1e-5)),
            "mismatch/k3": 1e-6 + abs(noise(1e-7)),
            "length/mean": 150 + noise(5),
            "length/max": 256,
            "length/trunc_frac": 0.02 + abs(noise(0.005)),
            "time/rollout": 12.0 + noise(0.5),
            "time/learner": 6.0 + noise(0.2),
            "time/weight_sync": 0.4 + abs(noise(0.02)),
            "time/step": 18.5 + noise(0.5),
            "throughput/tokens_per_s": 3500 + noise(50),
            "throughput/goodput": 5.0 * reward,  # the compute keys draw no noise: the other keys stay as they were
            "compute/mean_exit": float((np.arange(1, T + 1) * p).sum()),
            "compute/passes_per_token": float((np.arange(1, T + 1) * p).sum()) + 0.05,
            "compute/exit_entropy": float(-(p * np.log(p)).sum()),
            "memory/peak_gb": 21.5,
            "lr": 1e-5,
        }
        for t in range(1, T + 1):
            record[f"exit/p_{t}"] = float(p[t - 1])
            record[f"entropy/loop_{t}"] = 1.2 - 0.1 * t - 0.2 * frac + noise(0.01)
        for layer in range(layers):
            record[f"grad_norm/layer/{layer}"] = 0.2 + 0.02 * layer + abs(noise(0.01))
        records.append(record)
    return records


def mutate(records: list[dict[str, Any]], start: int,
           **changes: float | Callable[[int, dict[str, Any]], float]) -> list[dict[str, Any]]:
    """Set keys on the records from index ``start`` on (``/`` written as ``__`` in names).

    A callable value is called with (index, record).
    """
    for i, record in enumerate(records):
        if i < start:
            continue
        for name, value in changes.items():
            key = name.replace("__", "/")
            record[key] = value(i, record) if callable(value) else value
    return records


def write_run(run_dir: Path, records: list[dict[str, Any]], tail: str = "") -> Path:
    """Write ``records`` to ``run_dir/metrics.jsonl`` (plus a raw ``tail``); returns run_dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
        f.write(tail)
    return run_dir


def quickstart_records(n: int = 250, seed: int = 0, T: int = T_LOOPS, layers: int = 2,
                       eval_every: int = 50) -> list[dict[str, Any]]:
    """What `rltt train recipes/quickstart.yaml` logs on a healthy run, key for key.

    One PPO-clip update per batch (ratio exactly 1, nothing clipped), kl_coef = 0 with the
    reference tracked (KL 0 at step 1, then growing), lr warmup over 5 steps. The policy loss
    is token-mean advantage-weighted: noise around zero with occasional large relative jumps
    (one long completion with a large advantage), and loss/total equals it. The grad norm
    wanders (log-normal) without real spikes. Held-out eval at step 0 and every
    ``eval_every`` steps.
    """
    rng = np.random.default_rng(seed)
    records: list[dict[str, Any]] = [{"step": 0, "eval/solve_rate": 0.31, "eval/reward_mean": 0.31,
                                      "eval/compute/mean_exit": 4.0}]
    exit_p = np.array([0.05, 0.1, 0.25, 0.6][:T])
    exit_p = exit_p / exit_p.sum()
    for i in range(n):
        step = i + 1
        frac = i / max(n - 1, 1)
        noise = lambda scale: float(rng.normal(0.0, scale))  # noqa: E731
        solve = float(np.clip(0.32 + 0.2 * frac + noise(0.06), 0, 1))
        policy_loss = noise(0.01)
        if rng.random() < 0.03:  # a long completion with a large advantage dominates the mean
            policy_loss = float(rng.choice([-1, 1]) * rng.uniform(0.1, 0.2))
        p = np.clip(exit_p + rng.normal(0, 0.005, T), 1e-3, None)
        p = p / p.sum()
        length = 30 + noise(3)
        record: dict[str, Any] = {
            "step": step,
            "reward/mean": solve, "reward/std": float(np.sqrt(solve * (1 - solve))),
            "reward/errors": 0, "reward/gsm8k.strict": solve, "solve_rate": solve,
            "groups/uniform_frac": float(np.clip(0.3 - 0.1 * frac + noise(0.1), 0, 1)),
            "length/mean": length, "length/max": 48.0,
            "length/trunc_frac": float(np.clip(0.08 + noise(0.03), 0, 1)),
            "compute/mean_exit": 4.0, "compute/passes_per_token": 4.0, "compute/exit_entropy": 0.0,
            "rollout/sequences": 64, "throughput/goodput": 30.0 * solve,
            "time/rollout": 0.9 + abs(noise(0.1)),
            "throughput/tokens_per_s": 2100 + noise(100),
            "entropy/loop_1": 2.0 + noise(0.02), "entropy/loop_2": 1.7 + noise(0.02),
            "entropy/loop_3": 1.4 - 0.2 * frac + noise(0.02),
            "entropy/loop_4": 1.2 - 0.3 * frac + noise(0.02),
            "exit/mean_step": float((np.arange(1, T + 1) * p).sum()),
            "exit/collapse": 0.0, "exit/entropy": float(-(p * np.log(p)).sum()),
            "mismatch/max_abs": 4e-7 * (1 + abs(noise(0.5))),
            "mismatch/mean_abs": 3e-8 * (1 + abs(noise(0.5))),
            "mismatch/k3": 1e-15 * (1 + abs(noise(0.5))),
            "grad_norm/total": float(0.3 * np.exp(noise(0.3))),
            "loss/total": policy_loss, "loss/policy": policy_loss,
            "policy/clip_frac": 0.0, "policy/ratio_mean": 1.0, "policy/ratio_max": 1.0,
            "policy/ratio_min": 1.0,
            "lr": 1e-4 * min(1.0, step / 5),
            "kl/ref": 0.0 if step == 1 else float(0.05 * frac ** 1.5 * np.exp(noise(0.2))),
            "loss/kl": 0.0,
            "time/learner": 0.4 + abs(noise(0.05)), "time/weight_sync": 0.0,
            "time/step": 1.4 + abs(noise(0.1)), "memory/peak_gb": 0.9,
        }
        for t in range(1, T + 1):
            record[f"exit/p_{t}"] = float(p[t - 1])
        record["grad_norm/group/embed"] = record["grad_norm/total"] * 0.3
        record["grad_norm/group/block"] = record["grad_norm/total"] * 0.8
        record["grad_norm/group/gate"] = record["grad_norm/total"] * 0.01
        for layer in range(layers):
            record[f"grad_norm/layer/{layer}"] = record["grad_norm/total"] * (0.5 + 0.1 * layer)
        if step % eval_every == 0 or step == n:
            record.update({"eval/solve_rate": 0.31 + 0.16 * frac, "eval/reward_mean": 0.31 + 0.16 * frac,
                           "eval/compute/mean_exit": 4.0})
        records.append(record)
    return records


def lm_records(n: int = 120, seed: int = 0, T: int = 3) -> list[dict[str, Any]]:
    """What `rltt pretrain` logs on a healthy run: the LM loss falling and levelling off."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        step = i + 1
        loss = 2.2 + 4.0 * np.exp(-i / 15) + float(rng.normal(0, 0.03))
        record: dict[str, Any] = {
            "step": step, "lm/loss": loss, "loss/total": loss - 0.15 * 0.9,
            "grad_norm/total": float(0.8 * np.exp(rng.normal(0, 0.15))),
            "exit/p_1": 0.2, "exit/p_2": 0.3, "exit/p_3": 0.5, "exit/mean_step": 2.3,
            "exit/collapse": 0.0, "exit/entropy": 1.03, "lr": 1e-3 * min(1.0, step / 20),
            "time/step": 0.2, "throughput/tokens_per_s": 40000.0,
        }
        for t in range(1, T + 1):
            record[f"lm/loss_step_{t}"] = loss + 0.1 * (T - t)
        records.append(record)
    return records
