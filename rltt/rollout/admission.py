"""Admission policies of the decode loop (`rltt.rollout.decode_loop`): which row holds which slot, and when.

- `SeatAll`: every row of a batch of whole prompts holds a slot of its own (slot r = row r) from the
  first pass, after the prompts' shared prefill (`seat_all`); a finished row keeps its slot. A chunk of a
  call runs this way, and so does a multi-turn session, whose rows go on in their slots turn after turn.
- `Continuous`: a call's rows share fewer slots; rows are admitted one by one, in the batch's
  (prompt-major) order, into the slots of rows that finished (the slot is freed, its gates copied out).

A prompt several rows complete (``n > 1``, or the same prompt twice) has its positions ``0..P-2``
computed once at every step and shared. Seated all at once (`seat_all`), its first row computes them in
T passes over such leaders alone before the decoding starts, and the others receive a copy (a fork,
recorded on the last of those passes). Admitted one by one (`Continuous`), its first admitted row (the
*leader*) computes them as its own range ``0..P-2`` at steps 1..T in T passes that other rows' work
shares; a later row of the prompt copies that state from a slot that holds it — a live row of the prompt
or a finished one whose slot no row has taken since (in place, when it takes that very slot) — when it is
admitted, or, while the leader is still computing it, holds its slot and starts when the prefill ends (the
copy recorded on that pass). Each admission is recorded (`PassRecord.admit`: slot, row, source, length,
before its pass), so replay seats the same rows in the same slots.
"""

from __future__ import annotations

import torch

from rltt.rollout.rollout_batch import PassRecord

__all__ = ["Continuous", "SeatAll", "seat_all", "shared_prefill"]


class SeatAll:
    """Every row seated before the first pass (`seat_all`); slots kept when rows finish. ``waiting``:
    rows of later chunks of the call wait through every pass of this one."""

    frees = False

    def __init__(self, waiting: bool = False):
        self._waiting = waiting

    def admit(self, loop, call) -> list:
        return []

    def after_pass(self, loop, rows: list[int], call) -> list:
        return []

    def waiting(self) -> bool:
        return self._waiting


def seat_all(loop, prompts: list[list[int]], n: int) -> list[PassRecord]:
    """Seat the ``len(prompts) · n`` rows (prompt-major) in slots ``0..`` of ``loop`` and compute the
    prompts' shared prefill; returns its passes (none when no prompt is shared)."""
    index = [i for i in range(len(prompts)) for _ in range(n)]
    lengths = [len(prompts[i]) for i in index]
    for r, i in enumerate(index):
        loop.seat(r, r, prompts[i])
        loop.sched.admit(r, lengths[r], prefilled=False)
    loop.begin_all(list(range(len(index))), [p - 1 for p in lengths])
    return shared_prefill(loop, prompts, index, lengths)


def shared_prefill(loop, prompts: list[list[int]], prompt_index: list[int], lengths: list[int]) -> list[PassRecord]:
    """Compute each shared prompt's positions ``0..P-2`` once, at every step, in T serial passes over one
    row per prompt (its first), and fork that state to the prompt's other rows (recorded on the last
    pass). Every row then decodes from its last prompt token."""
    rows_of: dict[tuple[int, ...], list[int]] = {}
    for r, i in enumerate(prompt_index):
        rows_of.setdefault(tuple(prompts[i]), []).append(r)
    groups = [g for g in rows_of.values() if len(g) > 1 and lengths[g[0]] >= 2]
    if not groups:
        return []
    leaders = sorted(g[0] for g in groups)
    ends = [lengths[r] - 2 for r in leaders]
    records = []
    for step in range(1, loop.num_loops + 1):
        loop.executor.run(leaders, [0] * len(leaders), ends, [step] * len(leaders))
        records.append(PassRecord(
            work=torch.tensor([leaders, [0] * len(leaders), ends, [step] * len(leaders)], dtype=torch.long).T.contiguous(),
            exits=torch.zeros(0, dtype=torch.long)))
    fork = [[g[0], r, lengths[g[0]] - 1] for g in groups for r in g[1:]]
    loop.executor.fork(fork)
    records[-1].fork = torch.tensor(fork, dtype=torch.long)
    loop.sched.prefilled([r for g in groups for r in g], len(records))
    return records


class Continuous:
    """Rows admitted one by one into free slots (module docstring): the waiting queue, which prompt's
    shared prefix each slot holds intact, the leaders computing one, and the rows waiting for it."""

    frees = True

    def __init__(self, prompts: list[list[int]], n: int, num_slots: int):
        self.keys = [tuple(prompts[i]) for i in range(len(prompts)) for _ in range(n)]
        uses: dict[tuple, int] = {}
        for k in self.keys:
            uses[k] = uses.get(k, 0) + 1
        self.shared = [uses[k] > 1 and len(k) >= 2 for k in self.keys]  # as `shared_prefill` groups rows
        self.queued = 0  # the next row to admit
        self.holds: list[tuple | None] = [None] * num_slots  # the prompt whose prefix is complete there
        self.prefilling: dict[tuple, int] = {}  # prompt → its leader's slot, while it computes the prefix
        self.held: dict[tuple, list[int]] = {}  # prompt → slots of rows waiting for that prefix

    def waiting(self) -> bool:
        return self.queued < len(self.keys) or bool(self.held)

    def admit(self, loop, call) -> list[list[int]]:
        """Seat queued rows in the free slots (a slot holding the row's prefix first); their records."""
        done = []
        free = [s for s, b in enumerate(loop.row_of) if b < 0]
        while free and self.queued < len(self.keys):
            row, self.queued = self.queued, self.queued + 1
            key = self.keys[row]
            slot = next((s for s in free if self.holds[s] == key), free[0])
            free.remove(slot)
            src = -1
            if self.shared[row]:
                src = slot if self.holds[slot] == key else next(
                    (s for s, k in enumerate(self.holds) if k == key), -1)
            length = len(key) - 1 if src >= 0 else 0
            loop.seat(slot, row, list(key), src, length)
            done.append([slot, row, src, length])
            self.holds[slot] = key if src >= 0 else None
            if src >= 0:  # the prefix is there: decode from the last prompt token
                loop.sched.admit(slot, len(key), prefilled=True)
                call.row_passes[row] += loop.num_loops  # the shared prefill's passes, as seated rows count them
                loop.begin(slot, len(key) - 1)
            elif not self.shared[row]:  # the prompt computed with its first decode token
                loop.sched.admit(slot, len(key), prefilled=False)
                loop.begin(slot, len(key) - 1)
            elif key in self.prefilling:  # its leader is computing the prefix: wait for it
                self.held.setdefault(key, []).append(slot)
            else:  # the leader: compute the prefix
                self.prefilling[key] = slot
                loop.prefill[slot] = True
                loop.sched.admit(slot, len(key), prefilled=False, prefill=True)
        return done

    def after_pass(self, loop, rows: list[int], call) -> list[list[int]]:
        """Leaders whose prefix is complete decode from their last prompt token; the rows waiting for it
        receive a copy after this pass (its forks, returned)."""
        forks = []
        for s in rows:
            if loop.prefill[s] and loop.sched.depth[s] == loop.num_loops:
                loop.prefill[s] = False
                loop.sched.end_prefill(s)
                key = self.keys[loop.row_of[s]]
                del self.prefilling[key]
                self.holds[s] = key
                loop.begin(s, len(key) - 1)
                for w in self.held.pop(key, []):
                    forks.append([s, w, len(key) - 1])
                    self.holds[w] = key
                    loop.sched.admit(w, len(key), prefilled=True)
                    call.row_passes[loop.row_of[w]] += loop.num_loops
                    loop.begin(w, len(key) - 1)
        return forks
