"""Host memory of a partial rollout's buffer (``orchestration.partial_rollouts``).

With partial rollouts the Ray driver (`rltt.orchestration.ray.partial_step.PartialStep`) holds, between
steps and across them, up to K · P groups (K = ``orchestration.max_staleness``, P =
``rollout.prompts_per_step``) admitted and not yet trained: in flight (generated segment by segment)
or complete. Each of their G = ``group_size`` rows (`rltt.orchestration.ray.partial_rows.PartialRow`, the
row record `rltt.rollout.rows.Row`) keeps per completion token every field of `TOKEN_FIELDS` in host
arrays of the batch's dtypes: its id, exit step, three log-probs (sampled, tempered, exit), kept-set floor,
weights version, forced and environment flags, and one gate per loop; a row has at most W tokens, the completion
width (`rltt.planning.run_settings.completion_width`: ``rollout.max_new_tokens``, or a thinking
budget's forced completion when longer).
The buffer is host memory of the driver, written into every checkpoint (``rl_state.pt``)::

    partial_buffer = K · P · G · W · per_token
    per_token      = 8 (id) + 8 (exit step) + 4 · 3 (log-prob, tempered, exit log-prob)
                     + 8 (kept-set floor) + 8 (version) + 1 (forced) + 1 (environment's)
                     + 4 · T (gates, fp32, one per loop)
                   = 46 + 4 · T

The bound is reached when every held row runs to W tokens (a growing array may hold up to about 1/16
of its length more while it grows; a checkpoint writes the exact bytes). Groups dropped as stale keep no
rows (only their prompt, for the count). Not counted: each group's prompt (a Python list in its
task) and a segment call's batch while it is stitched into the rows (transient: the rows of one
segment, at most ``partial_segment_tokens`` tokens each). Measured: tests/planning/test_partial_buffer.py
(a full buffer's checkpoint state equals the bound, and no buffer exceeds it).
"""

from __future__ import annotations

from dataclasses import dataclass

from rltt.planning.run_settings import completion_width
from rltt.rollout.rows import token_bytes

@dataclass(frozen=True)
class PartialBuffer:
    """What the partial-buffer term depends on."""

    groups: int  # K · P: groups held at most
    group_size: int  # G
    tokens: int  # W: a row's most tokens
    loops: int  # T: gates per token

    @classmethod
    def from_recipe(cls, recipe, loops: int) -> "PartialBuffer":
        o, r = recipe.orchestration, recipe.rollout
        return cls(groups=o.staleness * r.prompts_per_step, group_size=r.group_size, tokens=completion_width(r),
                   loops=loops)

    @property
    def per_token(self) -> int:
        return token_bytes(self.loops)  # every per-token field of the row record, the gates per loop

    @property
    def bytes(self) -> int:
        return self.groups * self.group_size * self.tokens * self.per_token


def partial_rollouts(recipe) -> bool:
    o = recipe.orchestration
    return o.backend == "ray" and bool(getattr(o, "partial_rollouts", False)) and o.staleness > 0
