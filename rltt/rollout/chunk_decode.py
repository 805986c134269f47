"""How the native engine decodes one chunk of rows: its executor, scheduler and exit decider, and
the loop of passes (`NativeEngine.generate` runs a chunk to its end, `run_chunk`; a multi-turn
session keeps the chunk between turns, `ChunkState`, `open_chunk`, `decode_chunk`). The pass
function itself is `rltt.rollout.executor.PassExecutor`; what a pass computes, `Scheduler`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rltt.errors import RlttError
from rltt.model.exits import ExitPolicy
from rltt.model.modeling import LoopedForCausalLM
from rltt.rollout.attention import PassSetup
from rltt.rollout.rows import Row
from rltt.rollout.executor import PassExecutor
from rltt.rollout.host_work import end_passes, host_list, mark_pass
from rltt.rollout.kv_cache import upload
from rltt.rollout.params import SamplingParams
from rltt.rollout.rollout_batch import PassRecord, RolloutStats, Schedule
from rltt.rollout.sampler import ExitDecider, RowRandom, logprobs_of, sample, truncates
from rltt.rollout.scheduler import Scheduler


def check_prompts(prompts, vocab_size: int, max_positions: int) -> list[list[int]]:
    """Validate prompts (non-empty lists of in-vocabulary ids within the position limit)."""
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise RlttError("prompts: expected a non-empty list of token-id lists")
    out = []
    for i, prompt in enumerate(prompts):
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids:
            raise RlttError(f"prompts[{i}] is empty: a prompt needs at least one token (e.g. BOS)")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
            raise RlttError(f"prompts[{i}] holds a token id outside [0, {vocab_size}) or a non-int")
        if len(ids) > max_positions:
            raise RlttError(f"prompts[{i}] has {len(ids)} tokens, more than the model's "
                            f"max_position_embeddings={max_positions}")
        out.append(ids)
    return out


@dataclass
class _ChunkRun:
    """A chunk's rows (`Row`, with the gates of each row's completion tokens), its pass record
    (rows numbered from 0) and its `RolloutStats`."""

    rows: list[Row]
    schedule: Schedule
    stats: RolloutStats


def run_chunk(model: LoopedForCausalLM, prompts: list[list[int]], params: SamplingParams, policy: ExitPolicy,
              random: RowRandom, stops: set[int], setup: PassSetup | None = None) -> _ChunkRun:
    """Run one batch of whole prompts to the end (``random``: its rows' draws). Its `PassExecutor` —
    the KV cache — holds ``len(prompts) · n`` rows of the chunk's longest prompt plus the longest
    completion a row can reach (`kv_positions`), and goes when this returns. ``setup``: how the
    passes run (the engine's attention and buckets, `rltt.rollout.attention.PassSetup`)."""
    state, prefill = open_chunk(model, prompts, params, policy, random, setup=setup)
    return decode_chunk(state, params, stops, [params.max_new_tokens] * state.executor.num_rows, prefill)


@dataclass
class ChunkState:
    """A chunk between calls of `decode_chunk` (a multi-turn episode continues its rows,
    `rltt.rollout.continuation`): the executor (KV cache, carries, gates, tokens), the scheduler, the
    exit decider and the rows' keys; ``starts[r]``: the position of the state that produces row r's
    first completion token of the current call; ``counted[r]``: the serial passes of row r already
    reported by an earlier call."""

    model: LoopedForCausalLM
    policy: ExitPolicy
    random: RowRandom
    executor: PassExecutor
    sched: Scheduler
    decider: ExitDecider
    starts: list[int]
    counted: list[int]


def open_chunk(model: LoopedForCausalLM, prompts: list[list[int]], params: SamplingParams, policy: ExitPolicy,
               random: RowRandom, width: int | None = None,
               setup: PassSetup | None = None) -> tuple[ChunkState, list[PassRecord]]:
    """A chunk of ``len(prompts) · n`` rows ready to decode, and the passes of its shared prefill.
    The executor holds the longest prompt plus ``width`` completion positions per row (None: the
    longest completion ``params`` let a row reach, `kv_positions`), at most the model's positions."""
    cfg = model.config
    T = cfg.num_loops
    prompt_index = [i for i in range(len(prompts)) for _ in range(params.n)]
    lengths = [len(prompts[i]) for i in prompt_index]
    num_rows = len(prompt_index)
    max_positions = cfg.max_position_embeddings
    positions = (kv_positions(max(lengths), params, max_positions) if width is None
                 else min(max(lengths) + width, max_positions + 1))
    executor = PassExecutor(model, num_rows, positions, setup)
    for r, i in enumerate(prompt_index):
        executor.tokens[r, : lengths[r]] = torch.tensor(prompts[i])
    sched = Scheduler(params.schedule, T, lengths)
    decider = ExitDecider(policy, T, random, num_rows)
    decider.start_tokens(list(range(num_rows)), [0] * num_rows)
    prefill = shared_prefill(executor, prompts, prompt_index, lengths, T, sched)
    return ChunkState(model, policy, random, executor, sched, decider, [n - 1 for n in lengths],
                      [0] * num_rows), prefill


def decode_chunk(state: ChunkState, params: SamplingParams, stops: set[int], cap: list[int],
                 passes: list[PassRecord] = ()) -> _ChunkRun:
    """Run passes until no row of the chunk is active. ``cap[r]``: row r's completion tokens in this
    call; ``passes``: passes already run for this call (a shared prefill), first in its record. The
    `_ChunkRun` holds this call's tokens and passes, and the serial passes each row took part in
    since the previous call (`ChunkState.counted`)."""
    model, executor, sched, decider = state.model, state.executor, state.sched, state.decider
    policy, random = state.policy, state.random
    cfg = model.config
    T = cfg.num_loops
    num_rows = executor.num_rows
    thinking = params.thinking
    max_positions = cfg.max_position_embeddings  # read once: a config attribute costs a lookup chain

    out = [Row() for _ in range(num_rows)]
    cap = list(cap)  # each row's completion cap (a thinking budget's rule changes it)
    schedule = Schedule(params.schedule, replayable=True, attention=executor.attention)
    schedule.passes.extend(passes)
    # the prefill's entries from its host-side records (`PassRecord.entries` reads a tensor sum)
    entries = sum(e - s + 1 for p in schedule.passes for _, s, e, _ in host_list(p.work))
    known_exits = policy.kind in ("final", "fixed")  # no gate values needed to decide
    truncating = truncates(params, cfg.vocab_size)  # else every floor is NO_FLOOR
    # without stop tokens, stop strings or a thinking budget a row ends by its length alone: the
    # sampled tokens and log-probs stay on the device until the chunk ends (read once, in `_Deferred`)
    later = _Deferred() if not stops and not params.stop_strings and thinking is None else None
    count = [0] * num_rows  # completion tokens per row
    while sched.any_active():
        mark_pass()
        rows, starts, ends, steps = sched.plan()
        h, _, last = executor.run(rows, starts, ends, steps)
        sched.computed(rows, ends, steps)
        entries += sum(e - s + 1 for s, e in zip(starts, ends))

        cand = [i for i, r in enumerate(rows) if not sched.sampled[r]]
        chosen: list[int] = []
        if cand:
            if known_exits:  # decided on the host from the steps alone
                at = T if policy.kind == "final" else int(policy.value)
                chosen = [i for i in cand if steps[i] == at]
            else:  # the decode tokens' gates: the pass's one read when nothing else must reach the host
                gates = executor.decode_gates().cpu()
                decide = host_list(decider.exits(rows, torch.tensor(steps), gates))
                chosen = [i for i in cand if decide[i]]
        exit_rows = [rows[i] for i in chosen]
        if chosen:
            positions = [ends[i] + 1 for i in chosen]
            values = sample_exits(executor, h, last, chosen, exit_rows, positions, count, random, params, truncating)
            for r in exit_rows:
                count[r] += 1
                sched.exited(r)
            if later is not None:
                later.add(exit_rows, [steps[i] for i in chosen], values)
                for r, position in zip(exit_rows, positions):
                    if count[r] >= cap[r] or position >= max_positions:
                        out[r].finish = "length"
                        sched.finish(r)
            else:
                token_l, raw_l, tempered_l, floor_l = values.tolist()
                for r, i, position, token, lp, lp_t, floor in zip(exit_rows, chosen, positions, token_l, raw_l,
                                                                 tempered_l, floor_l):
                    row = out[r]
                    row.add(int(token), steps[i], lp, lp_t, int(floor))
                    reason, cap[r] = settle_token(row, r, position, cap[r], params, stops, executor, sched, count,
                                                  max_positions)
                    if reason:
                        row.finish = reason
                        sched.finish(r)
        schedule.passes.append(PassRecord(
            work=torch.tensor([rows, starts, ends, steps], dtype=torch.long).T.contiguous(),
            exits=torch.tensor(exit_rows, dtype=torch.long),
        ))
        moved = sched.settle()
        decider.start_tokens(moved, [count[r] for r in moved])
    end_passes()
    if later is not None:
        later.fill(out)

    row_passes = [a - b for a, b in zip(sched.row_passes, state.counted)]
    state.counted = list(sched.row_passes)
    stats = RolloutStats(
        passes=len(schedule.passes), row_passes=torch.tensor(row_passes), entries_computed=entries,
        entries_pending=sched.pending(), tokens=sum(len(row) for row in out),
    )
    # completion token 0 came from position `starts` (P - 1 in a first call); copied out, so the executor can go
    all_gates = executor.gates.cpu()  # one read
    starts = state.starts
    for r, row in enumerate(out):
        row.add_gates(all_gates[:, r, starts[r]: starts[r] + len(row)])
    return _ChunkRun(out, schedule, stats)


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
    ``"length"`` at the cap or the model's last position; None to go on. Every decode loop's rule."""
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
    """Sampled tokens and log-probs left on the device while a chunk runs (no row can stop on a
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
    """Positions a batch's KV cache needs: its longest prompt plus the longest completion a row can
    reach (``max_new_tokens``, or a thinking budget's forced completion if longer). A row never
    writes past position ``max_positions`` (it finishes with ``length`` there), so that bounds it
    too."""
    thinking = params.thinking
    width = params.max_new_tokens if thinking is None else max(params.max_new_tokens, thinking.max_completion)
    return min(longest_prompt + width, max_positions + 1)


def shared_prefill(executor: PassExecutor, prompts: list[list[int]], prompt_index: list[int], lengths: list[int],
                   num_loops: int, sched: Scheduler) -> list[PassRecord]:
    """Compute each prompt's positions ``0..P-2`` once, for all the rows that complete it.

    When several rows share a prompt (``n > 1`` completions, or repeated prompts), one row per
    prompt (its first) computes the prompt's positions before the last at every step, in T
    serial passes over those rows only, and the others receive a copy of that state (a fork,
    recorded on the last pass). Every row then starts decoding at its last prompt token as
    usual. Returns the passes run (none when no prompt is shared)."""
    rows_of: dict[tuple[int, ...], list[int]] = {}
    for r, i in enumerate(prompt_index):
        rows_of.setdefault(tuple(prompts[i]), []).append(r)
    groups = [g for g in rows_of.values() if len(g) > 1 and lengths[g[0]] >= 2]
    if not groups:
        return []
    leaders = sorted(g[0] for g in groups)
    ends = [lengths[r] - 2 for r in leaders]
    records = []
    for step in range(1, num_loops + 1):
        executor.run(leaders, [0] * len(leaders), ends, [step] * len(leaders))
        records.append(PassRecord(
            work=torch.tensor([leaders, [0] * len(leaders), ends, [step] * len(leaders)], dtype=torch.long).T.contiguous(),
            exits=torch.zeros(0, dtype=torch.long)))
    fork = [[g[0], r, lengths[g[0]] - 1] for g in groups for r in g[1:]]
    executor.fork(fork)
    records[-1].fork = torch.tensor(fork, dtype=torch.long)
    sched.prefilled([r for g in groups for r in g], len(records))
    return records
