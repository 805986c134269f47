"""Host memory of the rows an asynchronous run holds ahead (``orchestration.max_staleness`` K ≥ 1).

A Ray run with K ≥ 1 keeps up to K steps of scored rows sampled ahead of the learner in the
driver process (`rltt.orchestration.ray.overlap.OverlappedStep.ahead`: host memory, not a
device's), and writes them into every checkpoint (``rl_state.pt``). One step's rows are a
`LearnerBatch` of R = ``prompts_per_step`` × G rows padded to their longest sequence — at most
S = prompt + completion positions (`RunSettings.sequence_tokens`), so the figure is a bound —
with their rewards, advantages and per-group flags::

    held_ahead   = K · R · (S · per_position + per_row) + K · (R / G) · 1
    per_position = 8 (input ids) + 8 (attention mask, int64) + 1 (target mask) + 8 (exit steps)
                   + 4 (sampler log-probs) + 4 (sampler exit log-probs)
                   + 8 · [top-p / top-k: the kept-set floor]
                   + 8 · [partial rollouts: each token's weights version]
    per_row      = 4 (advantages) + 4 (rewards) + 8 · [algorithm.compute_cost > 0: the compute penalty]
    (R / G) · 1  = one uniform-group flag per group

Python lists of R task ids and prompt seeds ride along (tens of bytes a row); they are not counted.
Measured: tests/planning/test_held_rows.py (one step's rows, plain / top-p / compute cost) and
tests/orchestration/ray/test_async_faults.py (the rows in a K = 2 run's checkpoint). Partial
rollouts (``orchestration.partial_rollouts``) hold no steps ahead: their up to K · P groups in
progress are the plan's ``partial_buffer`` line instead (`rltt.planning.partial_buffer`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rltt.planning.partial_buffer import PartialBuffer, partial_rollouts

#: bytes per position of every (B, S) tensor a held step's `LearnerBatch` always has
ALWAYS = {"input_ids": 8, "attention_mask": 8, "target_mask": 1, "exit_steps": 8, "sampler_logprobs": 4,
          "sampler_exit_logprobs": 4}
KEPT_FLOOR = 8  # int64, with a top-p / top-k kept set
VERSIONS = 8  # int64, with partial rollouts
ROW = {"advantages": 4, "rewards": 4}
COMPUTE = 8  # float64, with algorithm.compute_cost > 0


@dataclass(frozen=True)
class HeldRows:
    """What the held-ahead term depends on."""

    steps: int  # K: steps of rows held ahead
    rows: int  # R: rows per step (all ranks': the driver holds whole steps)
    group_size: int
    positions: int  # S: prompt + completion positions, the bound on a step's padded width
    truncates: bool = False
    versions: bool = False
    compute: bool = False

    @classmethod
    def from_recipe(cls, recipe, positions: int) -> "HeldRows":
        o, r = recipe.orchestration, recipe.rollout
        steps = o.staleness if o.backend == "ray" else 0
        return cls(steps=steps, rows=r.prompts_per_step * r.group_size, group_size=r.group_size, positions=positions,
                   truncates=r.top_p < 1.0 or r.top_k > 0, versions=bool(getattr(o, "partial_rollouts", False)),
                   compute=recipe.algorithm.compute_cost > 0)

    @property
    def per_position(self) -> int:
        return sum(ALWAYS.values()) + KEPT_FLOOR * self.truncates + VERSIONS * self.versions

    @property
    def per_row(self) -> int:
        return sum(ROW.values()) + COMPUTE * self.compute

    def step_bytes(self, positions: int | None = None) -> int:
        """One held step's bytes at ``positions`` padded positions (default: the bound S)."""
        s = self.positions if positions is None else positions
        return self.rows * (s * self.per_position + self.per_row) + self.rows // self.group_size

    @property
    def bytes(self) -> int:
        return self.steps * self.step_bytes()


def host_terms(recipe, positions: int, loops: int) -> dict[str, int]:
    """The plan's host-memory lines: for a Ray run with K ≥ 1, ``held_ahead`` (the K-deep pipeline's
    steps of rows) or, with partial rollouts, ``partial_buffer`` (its groups in progress,
    `rltt.planning.partial_buffer`: such a run holds no steps ahead); else none."""
    if partial_rollouts(recipe):
        return {"partial_buffer": PartialBuffer.from_recipe(recipe, loops).bytes}
    held = HeldRows.from_recipe(recipe, positions)
    return {"held_ahead": held.bytes} if held.steps else {}
