"""Continuous batching in the native engine: a call's rows share ``chunk_rows`` slots of one executor,
and a row of the next prompt takes a slot as soon as a row finishes (docs/engine.md, "Continuous
batching").

Rows are admitted one by one, in the batch's (prompt-major) order, before the pass that first has
work for them. A prompt several rows complete (``n > 1``, or the same prompt twice) has its positions
``0..P-2`` computed once at every step and shared:

- its first admitted row (the *leader*) computes them as its own range ``0..P-2`` at steps 1..T in T
  passes (no exit; other rows' work shares those passes), then decodes from its last prompt token;
- a later row of the prompt copies that state from a slot that holds it — a live row of the prompt,
  or a finished one whose slot no row has taken since (in place, when it takes that very slot) —
  when it is admitted; while the leader is still computing it, the row holds its slot and starts
  when the prefill ends (the copy is recorded on that pass, `PassRecord.fork`).

A row's random draws are its own key's (`RowRandom`, keyed by its index in the batch, whatever slot
it runs in), so what a row samples depends on the batch composition of its passes only through
rounding, as with chunks, never through timing. The record (`PassRecord.admit`: slot, row, source,
length per admission, before its pass) lets `replay_logprobs` re-run the passes on an executor of
the same slots, bit for bit.
"""

from __future__ import annotations

import torch

from rltt.model.exits import ExitPolicy
from rltt.model.modeling import LoopedForCausalLM
from rltt.rollout.attention import PassSetup
from rltt.rollout.chunk_decode import _ChunkRun, _Deferred, kv_positions, sample_exits, settle_token
from rltt.rollout.executor import PassExecutor
from rltt.rollout.host_work import end_passes, host_list, mark_pass
from rltt.rollout.params import SamplingParams
from rltt.rollout.rollout_batch import PassRecord, RolloutStats, Schedule
from rltt.rollout.rows import Row
from rltt.rollout.sampler import ExitDecider, RowRandom, truncates
from rltt.rollout.scheduler import Scheduler


class _Slots:
    """Which row each slot holds, which prompt's shared prefix (positions ``0..P-2`` at every step) it
    holds intact, and the rows waiting for their prompt's prefill."""

    def __init__(self, num_slots: int):
        self.row = [-1] * num_slots  # the batch row in the slot, −1: free
        self.holds: list[tuple | None] = [None] * num_slots  # the prompt whose prefix is complete there
        self.prefilling: dict[tuple, int] = {}  # prompt → its leader's slot, while it computes the prefix
        self.waiting: dict[tuple, list[int]] = {}  # prompt → slots of rows waiting for that prefix

    def free(self) -> list[int]:
        return [s for s, r in enumerate(self.row) if r < 0]


def run_continuous(model: LoopedForCausalLM, prompts: list[list[int]], params: SamplingParams, policy: ExitPolicy,
                   random: RowRandom, stops: set[int], num_slots: int,
                   setup: PassSetup | None = None) -> _ChunkRun:
    """Run every row of the call (``len(prompts) · n``, prompt-major) on ``num_slots`` slots, admitting
    rows as slots free (see the module). The executor holds ``num_slots`` rows of the call's longest
    prompt plus the longest completion a row can reach. The record's work, exits and forks name
    slots; its admissions map slots to the batch's rows. ``random``: the draws of the call's rows."""
    cfg = model.config
    T = cfg.num_loops
    n = params.n
    prompt_index = [i for i in range(len(prompts)) for _ in range(n)]
    num_rows = len(prompt_index)
    S = min(num_slots, num_rows)
    max_positions = cfg.max_position_embeddings
    executor = PassExecutor(model, S, kv_positions(max(len(p) for p in prompts), params, max_positions), setup)
    sched = Scheduler(params.schedule, T, [1] * S)
    sched.active = [False] * S
    keys = [tuple(prompts[i]) for i in prompt_index]
    uses: dict[tuple, int] = {}
    for k in keys:
        uses[k] = uses.get(k, 0) + 1
    shared = [uses[k] > 1 and len(k) >= 2 for k in keys]  # as `shared_prefill` groups rows
    slot_random = random.take(0, S)  # every slot's key is set when a row takes it
    slot_random.keys, slot_random.host_keys = slot_random.keys.clone(), slot_random.host_keys.clone()
    decider = ExitDecider(policy, T, slot_random, S)
    slots = _Slots(S)
    prefill = [False] * S  # slot computing its prompt's shared prefix
    queue = list(range(num_rows))
    queued = 0  # next row of ``queue`` to admit

    thinking = params.thinking
    out = [Row() for _ in range(num_rows)]
    cap = [params.max_new_tokens] * num_rows
    row_passes = [0] * num_rows
    gates_of: list[torch.Tensor | None] = [None] * num_rows
    schedule = Schedule(params.schedule, replayable=True, attention=executor.attention)
    known_exits = policy.kind in ("final", "fixed")
    truncating = truncates(params, cfg.vocab_size)
    later = _Deferred() if not stops and not params.stop_strings and thinking is None else None
    count = [0] * S  # completion tokens of the slot's row
    entries = pending = 0
    occupied = waiting_occupied = 0.0
    waiting_passes = 0

    def start(slot: int) -> None:
        """The slot's row begins decoding (its token 0's exit draw)."""
        count[slot] = 0
        decider.start_tokens([slot], [0])

    def admit() -> list[list[int]]:
        nonlocal queued
        done = []
        free = slots.free()
        while free and queued < num_rows:
            row = queue[queued]
            queued += 1
            key = keys[row]
            P = len(key)
            slot = next((s for s in free if slots.holds[s] == key), free[0])  # a slot holding its prefix first
            free.remove(slot)
            src = -1
            if shared[row]:
                src = slot if slots.holds[slot] == key else next(
                    (s for s in range(S) if slots.holds[s] == key), -1)
            length = P - 1 if src >= 0 else 0
            executor.admit(slot, list(key), src, length)
            slots.row[slot] = row
            slot_random.keys[slot] = random.keys[row]
            slot_random.host_keys[slot] = random.host_keys[row]
            done.append([slot, row, src, length])
            if src >= 0:  # the prefix is there: decode from the last prompt token
                slots.holds[slot] = key
                sched.admit(slot, P, prefilled=True)
                row_passes[row] += T  # the shared prefill's passes, as a chunk counts them
                start(slot)
            elif not shared[row]:  # the prompt computed with its first decode token
                slots.holds[slot] = None
                sched.admit(slot, P, prefilled=False)
                start(slot)
            elif key in slots.prefilling:  # its leader is computing the prefix: wait for it
                slots.holds[slot] = None
                slots.waiting.setdefault(key, []).append(slot)
            else:  # the leader: compute the prefix
                slots.holds[slot] = None
                slots.prefilling[key] = slot
                prefill[slot] = True
                sched.admit(slot, P, prefilled=False, prefill=True)
        return done

    while True:
        admitted = admit()
        if not sched.any_active():
            break
        mark_pass()
        rows, starts, ends, steps = sched.plan()
        h, _, last = executor.run(rows, starts, ends, steps)
        sched.computed(rows, ends, steps)
        entries += sum(e - s + 1 for s, e in zip(starts, ends))
        for r in rows:
            row_passes[slots.row[r]] += 1
        occupied += len(rows) / S
        if queued < num_rows or slots.waiting:
            waiting_occupied += len(rows) / S
            waiting_passes += 1

        cand = [i for i, r in enumerate(rows) if not sched.sampled[r] and not prefill[r]]
        chosen: list[int] = []
        if cand:
            if known_exits:
                at = T if policy.kind == "final" else int(policy.value)
                chosen = [i for i in cand if steps[i] == at]
            else:
                gates = executor.decode_gates().cpu()
                decide = host_list(decider.exits(rows, torch.tensor(steps), gates))
                chosen = [i for i in cand if decide[i]]
        exit_slots = [rows[i] for i in chosen]
        finished: list[int] = []
        if chosen:
            positions = [ends[i] + 1 for i in chosen]
            values = sample_exits(executor, h, last, chosen, exit_slots, positions, count, slot_random, params,
                                  truncating)
            for r in exit_slots:
                count[r] += 1
                sched.exited(r)
            if later is not None:
                later.add([slots.row[r] for r in exit_slots], [steps[i] for i in chosen], values)
                for r, position in zip(exit_slots, positions):
                    b = slots.row[r]
                    if count[r] >= cap[b] or position >= max_positions:
                        out[b].finish = "length"
                        finished.append(r)
            else:
                token_l, raw_l, tempered_l, floor_l = values.tolist()
                for r, i, position, token, lp, lp_t, floor in zip(exit_slots, chosen, positions, token_l, raw_l,
                                                                 tempered_l, floor_l):
                    b = slots.row[r]
                    row = out[b]
                    row.add(int(token), steps[i], lp, lp_t, int(floor))
                    reason, cap[b] = settle_token(row, r, position, cap[b], params, stops, executor, sched, count,
                                                  max_positions)
                    if reason:
                        row.finish = reason
                        finished.append(r)
        # leaders whose prefix is complete decode from their last prompt token; the rows waiting for it
        # receive a copy after this pass (recorded as its fork)
        forks = []
        for r in rows:
            if prefill[r] and sched.depth[r] == T:
                prefill[r] = False
                sched.end_prefill(r)
                key = keys[slots.row[r]]
                del slots.prefilling[key]
                slots.holds[r] = key
                start(r)
                for w in slots.waiting.pop(key, []):
                    forks.append([r, w, len(key) - 1])
                    slots.holds[w] = key
                    sched.admit(w, len(key), prefilled=True)
                    row_passes[slots.row[w]] += T
                    start(w)
        if forks:
            executor.fork(forks)
        schedule.passes.append(PassRecord(
            work=torch.tensor([rows, starts, ends, steps], dtype=torch.long).T.contiguous(),
            exits=torch.tensor(exit_slots, dtype=torch.long),
            fork=torch.tensor(forks, dtype=torch.long) if forks else None,
            admit=torch.tensor(admitted, dtype=torch.long) if admitted else None,
        ))
        for r in finished:  # the slot frees: its row's gates are copied out first
            b = slots.row[r]
            sched.finish(r)
            begin = len(keys[b]) - 1
            gates_of[b] = _copy_out(executor.gates[:, r, begin: begin + count[r]])
            pending += sched.row_pending(r)
            slots.row[r] = -1
        moved = sched.settle()
        decider.start_tokens(moved, [count[r] for r in moved])
    end_passes()
    if later is not None:
        later.fill(out)
    stats = RolloutStats(
        passes=len(schedule.passes), row_passes=torch.tensor(row_passes), entries_computed=entries,
        entries_pending=pending, tokens=sum(len(row) for row in out), occupied=occupied,
        occupied_passes=len(schedule.passes), waiting_occupied=waiting_occupied, waiting_passes=waiting_passes)
    for b, row in enumerate(out):
        row.add_gates(gates_of[b].cpu())
    return _ChunkRun(out, schedule, stats)


def _copy_out(gates: torch.Tensor) -> torch.Tensor:
    """A finished row's gates copied out of its slot (held on the device until the call ends)."""
    return gates.clone()
