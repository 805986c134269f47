"""The non-finite guard: a step whose loss or gradients are not finite changes no weights.

Every training loop (pretrain, convert, RL) asks :func:`check` after the backward pass and
before ``optimizer.step``. A non-finite loss or gradient makes the loop skip the optimizer
step (the weights and the optimizer state stay as they were), and :class:`NonFiniteGuard`
records the skip: an alarm line in ``RUN_DIR/alarms.jsonl`` and the running count in the
metric ``guard/skipped_steps``. After ``max_consecutive`` skips in a row the run stops with a
one-line `RlttError` naming the step and the cause; the skipped steps never changed the
weights, so every checkpoint on disk holds finite weights and the newest one is the one to
resume from (after fixing the cause, e.g. a smaller learning rate).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from rltt.errors import RlttError
from rltt.telemetry import schema

#: The metric: steps skipped so far in the run.
SKIPPED_STEPS = schema.GUARD_SKIPPED_STEPS
ALARM_KIND = "non_finite"


def _finite_number(value) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value.detach()).all())
    return math.isfinite(float(value))


def _params(model_or_params) -> Iterable[torch.nn.Parameter]:
    if isinstance(model_or_params, torch.nn.Module):
        return model_or_params.parameters()
    return model_or_params


def nonfinite_grads(model_or_params) -> list[torch.Tensor]:
    """The gradients (of a module's parameters, or of a parameter list) holding a NaN or inf."""
    grads = [p.grad for p in _params(model_or_params) if p.grad is not None]
    if not grads:
        return []
    flags = torch.stack([torch.isfinite(g).all().to("cpu", non_blocking=True) for g in grads])  # one sync
    return [g for g, ok in zip(grads, flags.tolist()) if not ok]


def check(loss, model_or_params=None, names: dict | None = None) -> str | None:
    """Why this step must not update the weights, or None when it may.

    ``loss``: the loss that was back-propagated (a tensor, a float, or several of them);
    ``model_or_params``: the module (or parameters) whose ``.grad`` the optimizer will apply —
    pass None where the gradients are not visible (e.g. partitioned by DeepSpeed; its own
    overflow check covers them).
    """
    losses = loss if isinstance(loss, (list, tuple)) else [loss]
    bad = [v for v in losses if not _finite_number(v)]
    if bad:
        value = bad[0]
        if isinstance(value, torch.Tensor):
            flat = value.detach().float().reshape(-1)
            value = flat[~torch.isfinite(flat)][0]
        return f"loss is {float(value)}"
    if model_or_params is None:
        return None
    grads = nonfinite_grads(model_or_params)
    if grads:
        if names is None and isinstance(model_or_params, torch.nn.Module):
            names = {id(p.grad): n for n, p in model_or_params.named_parameters() if p.grad is not None}
        first = (names or {}).get(id(grads[0]), "a parameter")
        return f"non-finite gradient in {len(grads)} tensor(s), first {first}"
    return None


@dataclass
class NonFiniteGuard:
    """Counts skipped steps, writes their alarms and stops the run after ``max_consecutive``.

    ``run_dir`` None: nothing is written (non-main ranks, which also pass ``warn=False``: every
    rank counts, one rank speaks). The state round-trips through :meth:`state_dict` so a
    resumed run counts as the uninterrupted one would.
    """

    run_dir: Path | None = None
    max_consecutive: int = 3
    alarms_file: str = "alarms.jsonl"
    warn: bool = True
    skipped: int = 0
    consecutive: int = 0
    fired: list[dict] = field(default_factory=list)
    reason: str = ""

    def passed(self) -> None:
        """The step's update was applied."""
        self.consecutive = 0

    def skip(self, step: int, reason: str) -> None:
        """Record that ``step`` was skipped (no update) for ``reason``: an alarm line and a warning."""
        self.skipped += 1
        self.consecutive += 1
        self.reason = reason
        alarm = {"step": int(step), "kind": ALARM_KIND,
                 "message": f"step {step} skipped (no weight change): {reason} "
                            f"({self.consecutive} in a row, {self.skipped} in the run)"}
        self.fired.append(alarm)
        if self.warn:
            print(f"WARNING step {step}: {alarm['message']}", file=sys.stderr)
        if self.run_dir is not None:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(self.run_dir) / self.alarms_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(alarm) + "\n")

    def step(self, step: int, reason: str | None) -> bool:
        """Record the outcome of ``step`` (``reason`` from :func:`check`); True when it was skipped."""
        if reason is None:
            self.passed()
            return False
        self.skip(step, reason)
        return True

    @property
    def exhausted(self) -> bool:
        return self.max_consecutive > 0 and self.consecutive >= self.max_consecutive

    def check_stop(self, step: int) -> None:
        """Raise the one-line `RlttError` that stops the run once ``max_consecutive`` steps in a
        row were skipped (call it after the step's metrics are logged, before its checkpoint)."""
        if self.exhausted:
            raise RlttError(f"step {step}: stopped after {self.consecutive} consecutive non-finite steps "
                            f"({self.reason}); those steps changed no weights, so the newest checkpoint is the "
                            f"last good one (fix the cause, e.g. lower the learning rate, then --resume)")

    def metrics(self) -> dict:
        return {SKIPPED_STEPS: self.skipped}

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "consecutive": self.consecutive, "reason": self.reason,
                "fired": [dict(a) for a in self.fired]}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.consecutive = int(state["skipped"]), int(state["consecutive"])
        self.reason = str(state.get("reason", ""))
        self.fired = [dict(a) for a in state.get("fired", [])]


__all__ = ["ALARM_KIND", "NonFiniteGuard", "SKIPPED_STEPS", "check", "nonfinite_grads"]
