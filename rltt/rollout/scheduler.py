"""Which (token, step) entries each serial pass computes: the `dense` and `deferred` schedules.

Every active row has one *decode token* (position ``cursor``: the token whose state produces
the row's next token) and advances it by one step per pass, so rows never wait for each other
(depth-mixed batching, docs/design.md §2.1–2.3). For every step s the entries computed so far form a prefix
of the row's positions, ``frontier[s]``: whenever step s is computed for a token, the pending
step-s entries of all earlier tokens are computed in the same pass. So a pass asks, per row,
for step ``s = depth + 1`` at the contiguous positions ``frontier[s] .. cursor``; their step
s−1 states exist because the decode token's own step s−1 pass brought every earlier token to
depth s−1. The prompt is no special case: its tokens start pending at depth 0 and are
computed by the same rule (prefill), step by step.

- ``dense``: the decode token runs all T steps; it is sampled at its exit step t* and keeps
  going to T before the next token starts (nothing is ever pending after the prompt).
- ``deferred``: the next token starts right after the exit at t*; steps t*+1..T of the token
  stay pending until (unless) a later token needs them.
"""

from __future__ import annotations


class Scheduler:
    """Per-row decode state and the pass plans of one rollout."""

    def __init__(self, kind: str, num_loops: int, prompt_lengths: list[int]):
        self.kind, self.num_loops = kind, num_loops
        rows = len(prompt_lengths)
        self.cursor = [p - 1 for p in prompt_lengths]
        self.depth = [0] * rows  # steps computed of the decode token
        self.sampled = [False] * rows  # decode token already exited (dense: still running to T)
        self.frontier = [[0] * num_loops for _ in range(rows)]
        self.active = [True] * rows
        self.row_passes = [0] * rows
        self.skip = [0] * rows  # forced tokens written after the decode token's sampled one

    @classmethod
    def vacant(cls, kind: str, num_loops: int, num_slots: int) -> "Scheduler":
        """``num_slots`` slots holding no row yet: each starts one with `admit`."""
        sched = cls(kind, num_loops, [1] * num_slots)
        sched.active = [False] * num_slots
        return sched

    def prefilled(self, rows: list[int], passes: int) -> None:
        """``rows`` had positions ``0..cursor-1`` computed at every step by a shared prefill of
        ``passes`` serial passes (every row waited for them)."""
        for r in rows:
            self.frontier[r] = [self.cursor[r]] * self.num_loops
        self.row_passes = [n + passes for n in self.row_passes]

    def admit(self, row: int, prompt_length: int, prefilled: bool, prefill: bool = False) -> None:
        """Slot ``row`` starts a new row (`rltt.rollout.admission`) of a prompt of
        ``prompt_length`` tokens: ``prefilled`` — positions ``0..P-2`` are computed at every step (a
        shared prefill copied in); ``prefill`` — the row first computes those positions at steps 1..T
        as its own range ``0..P-2`` (T passes, no exit), then decodes (`end_prefill`); neither — its
        prompt is computed by the frontier rule with its first decode token."""
        p = prompt_length - 1
        self.cursor[row] = p - 1 if prefill else p
        self.depth[row], self.sampled[row], self.skip[row] = 0, False, 0
        self.frontier[row] = [p if prefilled else 0] * self.num_loops
        self.active[row] = True

    def end_prefill(self, row: int) -> None:
        """Slot ``row`` computed its prompt's positions ``0..P-2`` at every step: its decode token, the
        last prompt token, starts at depth 0."""
        self.cursor[row] += 1
        self.depth[row] = 0

    def row_pending(self, row: int) -> int:
        """(token, step) entries of ``row``'s processed tokens not computed."""
        return sum(self.cursor[row] + 1 - f for f in self.frontier[row])

    def any_active(self) -> bool:
        return any(self.active)

    def plan(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """The next pass: ``(rows, starts, ends, steps)`` sorted by (step, row)."""
        work = sorted((self.depth[r] + 1, r) for r, on in enumerate(self.active) if on)
        steps = [s for s, _ in work]
        rows = [r for _, r in work]
        starts = [self.frontier[r][s - 1] for s, r in work]
        ends = [self.cursor[r] for r in rows]
        return rows, starts, ends, steps

    def computed(self, rows: list[int], ends: list[int], steps: list[int]) -> None:
        """Record that a pass computed ``steps`` up to ``ends`` for ``rows``."""
        for r, e, s in zip(rows, ends, steps):
            self.frontier[r][s - 1] = e + 1
            self.depth[r] = s
            self.row_passes[r] += 1

    def exited(self, row: int) -> None:
        """The decode token of ``row`` was sampled at its current step."""
        self.sampled[row] = True

    def force(self, row: int, count: int) -> None:
        """``count`` forced tokens follow the token the row just sampled: when it settles, its
        cursor moves past them to the last one, and they are computed like prompt tokens
        (pending at depth 0, by the frontier rule) in the passes of that decode token."""
        self.skip[row] = count

    def finish(self, row: int) -> None:
        self.active[row] = False

    def resume(self, row: int, count: int) -> None:
        """Continue a finished row (a later turn of a multi-turn episode): ``count`` tokens were
        appended after the token it sampled last, and its next decode token is the last of them
        (the sampled token itself when ``count`` is 0). Like forced tokens they start pending at
        depth 0 and are computed by the frontier rule — the sampled token's pending steps with them
        — in the passes of that decode token; the computed entries of every earlier position stay
        as they are."""
        if self.active[row]:
            raise ValueError(f"Scheduler.resume: row {row} has not finished")
        self.cursor[row] += 1 + count
        self.depth[row], self.sampled[row], self.skip[row] = 0, False, 0
        self.active[row] = True

    def settle(self) -> list[int]:
        """Move rows whose decode token is done to their next token; returns those rows."""
        moved = []
        for r, on in enumerate(self.active):
            if on and self.sampled[r] and (self.kind == "deferred" or self.depth[r] == self.num_loops):
                self.cursor[r] += 1 + self.skip[r]
                self.skip[r] = 0
                self.depth[r], self.sampled[r] = 0, False
                moved.append(r)
        return moved

    def pending(self) -> int:
        """(token, step) entries of processed tokens not computed (positions 0..cursor)."""
        return sum(self.cursor[r] + 1 - f for r in range(len(self.cursor)) for f in self.frontier[r])
