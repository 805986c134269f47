"""The native engine's one decode loop: slots, admission, passes, settle (docs/engine.md, "The decode loop").

The work is divided as in vLLM. An *admission policy* (`rltt.rollout.admission`) decides which row holds
which of the loop's slots and when a row enters: every row of a chunk of whole prompts seated before the
first pass (`SeatAll`, also a multi-turn session's rows, which keep their slots between turns), or rows
one by one as slots free (`Continuous`). The `Scheduler` decides what each pass computes for the seated
rows; the `PassExecutor` runs the pass; `DecodeLoop.settle` decides the exits, samples their tokens,
applies the stop rules and finishes rows, whose slots the policy frees or keeps. Every pass is recorded
(`PassRecord`: work, exits, forks, admissions), and `rltt.rollout.replay` re-runs any record this loop
writes through the same executor, bit for bit.

A row's random draws are its own key's (`RowRandom`, by its index in the call whatever slot it runs in),
so what a row samples depends on which rows share its passes only through rounding, never through timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rltt.model.exits import ExitPolicy
from rltt.model.modeling import LoopedForCausalLM
from rltt.rollout.attention import PassSetup
from rltt.rollout.executor import PassExecutor
from rltt.rollout.host_work import end_passes, host_list, mark_pass
from rltt.rollout.kv_cache import upload
from rltt.rollout.params import SamplingParams
from rltt.rollout.rollout_batch import PassRecord, RolloutStats, Schedule
from rltt.rollout.rows import Row
from rltt.rollout.sampler import ExitDecider, RowRandom, logprobs_of, sample, truncates
from rltt.rollout.scheduler import Scheduler


@dataclass
class LoopRun:
    """One call of the loop: its rows (`Row`, with the gates of each row's completion tokens; rows not
    in the call are empty), its pass record (slots numbered from 0) and its `RolloutStats`."""

    rows: list[Row]
    schedule: Schedule
    stats: RolloutStats


@dataclass
class _Call:
    """What one `DecodeLoop.run` accumulates: the call's rows and caps, its record and counts."""

    out: list[Row]
    cap: list[int]
    schedule: Schedule
    row_passes: list[int]
    gates: dict[int, torch.Tensor] = field(default_factory=dict)  # rows whose slot was freed: their gates
    entries: int = 0
    pending: int = 0  # entries left pending by rows whose slot was freed
    waiting_passes: int = 0
    waiting_items: int = 0


class DecodeLoop:
    """``num_slots`` slots of one `PassExecutor` (the KV cache: ``max_len`` positions per slot) and the
    state that lives as long as it: the scheduler, the exit decider, each slot's row and random key, the
    completion tokens each slot's row sampled in the current call. ``random``: the keys of the loop's
    rows (numbered from 0), which a slot takes when its row is seated (`seat`)."""

    def __init__(self, model: LoopedForCausalLM, num_slots: int, max_len: int, params: SamplingParams,
                 policy: ExitPolicy, random: RowRandom, stops: set[int], setup: PassSetup | None = None):
        cfg = model.config
        self.params, self.policy, self.stops, self.random = params, policy, stops, random
        self.num_loops, self.max_positions = cfg.num_loops, cfg.max_position_embeddings
        self.executor = PassExecutor(model, num_slots, max_len, setup)
        self.sched = Scheduler.vacant(params.schedule, cfg.num_loops, num_slots)
        self.slot_random = random.slots(num_slots)
        self.decider = ExitDecider(policy, cfg.num_loops, self.slot_random, num_slots)
        self.row_of = [-1] * num_slots  # the loop row a slot holds, −1: free
        self.start = [0] * num_slots  # the position whose state produces the slot's first token of the call
        self.count = [0] * num_slots  # completion tokens of the slot's row in the current call
        self.prefill = [False] * num_slots  # a slot computing its prompt's shared prefix (no exits)
        self.truncating = truncates(params, cfg.vocab_size)  # else every kept-set floor is NO_FLOOR

    @property
    def num_slots(self) -> int:
        return self.executor.num_rows

    def seat(self, slot: int, row: int, tokens: list[int], src: int = -1, length: int = 0) -> None:
        """Slot ``slot`` holds loop row ``row`` from now on: its ``tokens`` written (positions from 0), with
        ``src ≥ 0`` the computed state of positions ``0..length-1`` taken from slot ``src``, and its key."""
        self.executor.admit(slot, tokens, src, length)
        self.row_of[slot] = row
        self.slot_random.assign(slot, self.random, row)

    def begin(self, slot: int, start: int) -> None:
        """The slot's row starts its call's first token (the state at ``start`` produces it)."""
        self.begin_all([slot], [start])

    def begin_all(self, slots: list[int], starts: list[int]) -> None:
        """`begin` for several slots at once (one draw of their exit uniforms)."""
        for slot, start in zip(slots, starts):
            self.start[slot], self.count[slot] = start, 0
        self.decider.start_tokens(slots, [0] * len(slots))

    def run(self, admission, caps: list[int], first_passes: list[PassRecord] = (), bound: int | None = None) -> LoopRun:
        """Run passes until no seated row is active and ``admission`` seats none (``caps[row]``: the row's
        completion tokens in this call; ``first_passes``: passes already run for this call, a shared
        prefill, first in its record). The occupancy counts each pass's live rows over ``bound`` (the
        engine's row bound; None: the slots)."""
        params, sched, executor = self.params, self.sched, self.executor
        call = _Call([Row() for _ in caps], list(caps), Schedule(params.schedule, replayable=True,
                                                                 attention=executor.attention),
                     [len(first_passes) if c else 0 for c in caps])
        call.schedule.passes.extend(first_passes)
        # the prefill's entries from its host-side records (`PassRecord.entries` reads a tensor sum)
        call.entries = sum(e - s + 1 for p in first_passes for _, s, e, _ in host_list(p.work))
        if first_passes and admission.waiting():
            call.waiting_passes, call.waiting_items = len(first_passes), sum(len(p.work) for p in first_passes)
        # without stop tokens, stop strings or a thinking budget a row ends by its length alone: the sampled
        # tokens and log-probs stay on the device until the call ends (read once, in `_Deferred`)
        later = _Deferred() if not self.stops and not params.stop_strings and params.thinking is None else None
        while True:
            admitted = admission.admit(self, call)
            if not sched.any_active():
                break
            mark_pass()
            rows, starts, ends, steps = sched.plan()
            h, _, last = executor.run(rows, starts, ends, steps)
            sched.computed(rows, ends, steps)
            call.entries += sum(e - s + 1 for s, e in zip(starts, ends))
            for slot in rows:
                call.row_passes[self.row_of[slot]] += 1
            if admission.waiting():
                call.waiting_passes += 1
                call.waiting_items += len(rows)
            chosen = self._exits(rows, steps)
            finished = self.settle(call, h, last, rows, ends, steps, chosen, later)
            forks = admission.after_pass(self, rows, call)
            if forks:
                executor.fork(forks)
            call.schedule.passes.append(PassRecord(
                work=torch.tensor([rows, starts, ends, steps], dtype=torch.long).T.contiguous(),
                exits=torch.tensor([rows[i] for i in chosen], dtype=torch.long),
                fork=torch.tensor(forks, dtype=torch.long) if forks else None,
                admit=torch.tensor(admitted, dtype=torch.long) if admitted else None))
            for slot in finished:
                sched.finish(slot)
                if admission.frees:
                    self._free(slot, call)
            moved = sched.settle()
            self.decider.start_tokens(moved, [self.count[s] for s in moved])
        end_passes()
        if later is not None:
            later.fill(call.out)
        return self._result(call, bound or self.num_slots)

    def _exits(self, rows: list[int], steps: list[int]) -> list[int]:
        """The items of the pass whose decode token exits at its step."""
        cand = [i for i, s in enumerate(rows) if not self.sched.sampled[s] and not self.prefill[s]]
        if not cand:
            return []
        kind = self.policy.kind
        if kind in ("final", "fixed"):  # decided on the host from the steps alone
            at = self.num_loops if kind == "final" else int(self.policy.value)
            return [i for i in cand if steps[i] == at]
        gates = self.executor.decode_gates().cpu()  # the pass's one read when nothing else must reach the host
        decide = host_list(self.decider.exits(rows, torch.tensor(steps), gates))
        return [i for i in cand if decide[i]]

    def settle(self, call: _Call, h: torch.Tensor, last: torch.Tensor, rows: list[int], ends: list[int],
               steps: list[int], chosen: list[int], later: "_Deferred | None") -> list[int]:
        """Sample the exits ``chosen`` (items of the pass), append their tokens to their rows and apply the
        stop rules (`settle_token`); returns the slots whose row finished."""
        if not chosen:
            return []
        slots = [rows[i] for i in chosen]
        positions = [ends[i] + 1 for i in chosen]
        values = sample_exits(self.executor, h, last, chosen, slots, positions, self.count, self.slot_random,
                              self.params, self.truncating)
        for s in slots:
            self.count[s] += 1
            self.sched.exited(s)
        finished = []
        if later is not None:
            later.add([self.row_of[s] for s in slots], [steps[i] for i in chosen], values)
            for s, position in zip(slots, positions):
                if self.count[s] >= call.cap[self.row_of[s]] or position >= self.max_positions:
                    call.out[self.row_of[s]].finish = "length"
                    finished.append(s)
            return finished
        for s, i, position, token, lp, lp_t, floor in zip(slots, chosen, positions, *values.tolist()):
            b = self.row_of[s]
            row = call.out[b]
            row.add(int(token), steps[i], lp, lp_t, int(floor))
            reason, call.cap[b] = settle_token(row, s, position, call.cap[b], self.params, self.stops,
                                               self.executor, self.sched, self.count, self.max_positions)
            if reason:
                row.finish = reason
                finished.append(s)
        return finished

    def _free(self, slot: int, call: _Call) -> None:
        """The slot's row leaves it: its gates copied out first (kept on the device until the call ends)."""
        b, begin = self.row_of[slot], self.start[slot]
        call.gates[b] = _copy_out(self.executor.gates[:, slot, begin: begin + self.count[slot]])
        call.pending += self.sched.row_pending(slot)
        self.row_of[slot] = -1

    def _result(self, call: _Call, bound: int) -> LoopRun:
        seated = [s for s, b in enumerate(self.row_of) if b >= 0]
        schedule = call.schedule
        stats = RolloutStats(
            passes=len(schedule.passes), row_passes=torch.tensor(call.row_passes), entries_computed=call.entries,
            entries_pending=call.pending + sum(self.sched.row_pending(s) for s in seated),
            tokens=sum(len(row) for row in call.out), occupied=sum(len(p.work) for p in schedule.passes) / bound,
            occupied_passes=len(schedule.passes), waiting_occupied=call.waiting_items / bound,
            waiting_passes=call.waiting_passes)
        held = self.executor.gates.cpu() if seated else None  # one read for the rows still seated
        for s in seated:
            row = call.out[self.row_of[s]]
            row.add_gates(held[:, s, self.start[s]: self.start[s] + len(row)])
        for b, gates in call.gates.items():
            call.out[b].add_gates(gates.cpu())
        return LoopRun(call.out, schedule, stats)


def _copy_out(gates: torch.Tensor) -> torch.Tensor:
    """A leaving row's gates copied out of its slot (held on the device until the call ends)."""
    return gates.clone()


def sample_exits(executor: PassExecutor, h: torch.Tensor, last: torch.Tensor, chosen: list[int], exit_rows: list[int],
                 positions: list[int], count: list[int], random: RowRandom, params: SamplingParams,
                 truncating: bool) -> torch.Tensor:
    """Sample the tokens of a pass's exits: items ``chosen`` of ``h`` (executor rows ``exit_rows``,
    their next tokens at ``positions``), each row drawing its ``count[row]``-th token from its own key;
    the tokens are written into the executor. Returns (4, k) float64 — tokens, raw and tempered
    log-probs, kept-set floors (fp32 and int64 values are exact in float64: one read of the four)."""
    # one upload: the exit items, the rows' draw counters and the token cells
    pick, rows_d, counters, cells = upload([[] if len(chosen) == len(h) else chosen, exit_rows,
                                            [count[r] for r in exit_rows],
                                            [r * executor.max_len + p for r, p in zip(exit_rows, positions)]],
                                           executor.device)
    # every item exits (one position per row, all chosen): h is already the exit states
    logits = executor.logits(h if len(chosen) == len(h) else h[last[pick]])
    uniforms = None if params.greedy else random.uniform(rows_d, counters, RowRandom.TOKEN)
    tokens, floors = sample(logits, params, uniforms)
    raw, tempered = logprobs_of(logits, tokens, params.temperature, floors if truncating else None)
    executor.write_tokens(cells, tokens)
    return torch.stack([tokens.double(), raw.double(), tempered.double(), floors.double()])


def settle_token(row: Row, slot: int, position: int, cap: int, params: SamplingParams, stops: set[int],
                 executor: PassExecutor, sched: Scheduler, count: list[int],
                 max_positions: int) -> tuple[str | None, int]:
    """Whether ``row`` ends with the token just appended (sampled at ``position`` by executor row
    ``slot``), and its completion cap after it: ``"stop"`` on a stop token or string; at a thinking
    budget the forced-answer rule (the interruption written into the executor, the row, the
    scheduler and ``count[slot]``; the next sampled token needs a position below the model's last);
    ``"length"`` at the cap or the model's last position; None to go on."""
    thinking = params.thinking
    token = row.values["completion_ids"][-1]
    reason = "stop" if token in stops or (params.stop_strings and params.stop_string_in(row.ids)) else None
    if reason is None and thinking is not None and len(row) == thinking.budget:
        then = thinking.at_budget(row.ids, params.max_new_tokens, max_positions - position)
        if then is None:
            return "length", cap
        ids, cap = then
        if ids:
            executor.tokens[slot, position + 1: position + 1 + len(ids)] = torch.tensor(ids, device=executor.device)
            row.force(ids)
            count[slot] += len(ids)
            sched.force(slot, len(ids))
            position += len(ids)
    if reason is None and (len(row) >= cap or position >= max_positions):
        reason = "length"  # the next token would need a position the model does not have
    return reason, cap


class _Deferred:
    """Sampled tokens and log-probs left on the device while a call runs (no row can stop on a
    token): each pass's exit rows, steps and (4, k) float64 values; `fill` reads them all at once."""

    def __init__(self):
        self.rows: list[int] = []
        self.steps: list[int] = []
        self.values: list[torch.Tensor] = []

    def add(self, rows: list[int], steps: list[int], values: torch.Tensor) -> None:
        self.rows += rows
        self.steps += steps
        self.values.append(values)

    def fill(self, out: list[Row]) -> None:
        if not self.values:
            return
        tokens, raw, tempered, floors = torch.cat(self.values, dim=1).tolist()
        for r, step, token, lp, lp_t, floor in zip(self.rows, self.steps, tokens, raw, tempered, floors):
            out[r].add(int(token), step, lp, lp_t, int(floor))


def kv_positions(longest_prompt: int, params: SamplingParams, max_positions: int) -> int:
    """Positions a loop's KV cache needs: its longest prompt plus the longest completion a row can
    reach (``max_new_tokens``, or a thinking budget's forced completion if longer). A row never
    writes past position ``max_positions`` (it finishes with ``length`` there), so that bounds it
    too."""
    thinking = params.thinking
    width = params.max_new_tokens if thinking is None else max(params.max_new_tokens, thinking.max_completion)
    return min(longest_prompt + width, max_positions + 1)
