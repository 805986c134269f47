"""The native engine's turn sessions: a row's KV cache and decode state live on between turns.

`native_turns` (what `NativeEngine.open_turns` returns) opens one `ContinuedTurns` per chunk of
whole prompts (`NativeEngine.chunks`), one at a time. A session's `PassExecutor` is made once, for
its rows' longest prompt plus the episode's completion budget, and kept until the session closes:

- **the first turn** is the chunk's ordinary rollout on a decode loop whose slots its rows keep
  (`rltt.rollout.decode_loop.DecodeLoop`, `rltt.rollout.admission.SeatAll`: shared prefill, passes,
  exits), with the keys the whole call gives its rows;
- **a later turn** of row r appends what came after the token it sampled last (the environment's
  answer) to the row's tokens and resumes its scheduler row (`Scheduler.resume`): the appended
  tokens — and the pending steps of the last sampled token — start pending at depth 0 and are
  computed by the frontier rule, at every step, in the passes of the row's new decode token (the
  last appended token), exactly as forced tokens are; every entry computed in an earlier turn (KV
  of every step, carries, gates) is reused as it is. The row draws from its turn seed
  (``params.prompt_seeds``: the same key and counters a re-submitted prompt with that seed gets),
  its token counter restarting at 0;
- every pass of every turn is recorded in order, rows numbered in the session: `record` is a
  `Schedule` that `replay_logprobs` re-executes on one executor of the session's rows, with the
  episode's tokens (prompt, turns and answers) — so the episode batch itself replays bit for bit.
  A later turn's own batch (its prompt = the row's sequence) is not replayable alone
  (``schedule.replayable`` False): its passes read KV computed in earlier turns.

A continued row and the same row re-submitted as a new prompt draw the same uniforms, but their
history's KV is computed in different passes (batch compositions), so their log-probs agree to
rounding, not bit for bit: the exactness contract of a continued row is stated against its own
record (docs/environments.md).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Iterator

import torch

from rltt.errors import RlttError
from rltt.rollout.admission import SeatAll, seat_all
from rltt.rollout.decode_loop import DecodeLoop
from rltt.rollout.rows import rows_batch
from rltt.rollout.params import SamplingParams, check_prompts, stop_token_set
from rltt.rollout.rollout_batch import PassRecord, RolloutBatch, Schedule
from rltt.rollout.sampler import RowRandom
from rltt.rollout.turns import TurnSession

if TYPE_CHECKING:
    from rltt.rollout.native import NativeEngine

__all__ = ["ContinuedTurns", "native_turns"]


def native_turns(engine: "NativeEngine", prompts: list[list[int]], params: SamplingParams,
                 max_tokens: int) -> Iterator["ContinuedTurns"]:
    """`NativeEngine.open_turns`: one `ContinuedTurns` per chunk of whole prompts, opened when the
    caller asks for it and closed when it asks for the next (or stops)."""
    model = engine.model
    cfg = model.config
    T = cfg.num_loops
    params.validate(T, cfg.vocab_size)
    prompts = check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings)
    params.check_prompt_seeds(len(prompts))
    if params.thinking is not None:
        raise RlttError("SamplingParams.thinking: a thinking budget is per completion; multi-turn episodes take none")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RlttError(f"open_turns: max_tokens must be an int >= 1, got {max_tokens!r}")
    policy = model.exit_policy(params.exit_policy)
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    n = params.n
    random = RowRandom(seed, model.lm_head.weight.device, len(prompts) * n, params.prompt_seeds, n)
    stops = stop_token_set(params, cfg)
    width = max(max_tokens, params.max_new_tokens)
    for first, end in engine.chunks(len(prompts), n):
        session = ContinuedTurns(engine, prompts[first:end], replace(params, seed=seed), policy,
                                 random.take(first * n, end * n), stops, width, first, n)
        try:
            yield session
        finally:
            session.close()


class ContinuedTurns(TurnSession):
    """The turns of one chunk of whole prompts on one executor kept between turns (module docstring)."""

    def __init__(self, engine: "NativeEngine", prompts: list[list[int]], params: SamplingParams, policy,
                 random: RowRandom, stops: set[int], width: int, first_prompt: int, n: int):
        self.model = engine.model
        self.setup = engine.setup  # the engine's passes (attention, buckets), as `NativeEngine.generate` runs them
        self.attention = engine.attention
        self.prompts, self.params, self.policy, self.stops, self.width = prompts, params, policy, stops, width
        self.random = random
        self.first_prompt, self.end_prompt = first_prompt, first_prompt + len(prompts)
        self.first_row, self.end_row = first_prompt * n, (first_prompt + len(prompts)) * n
        self.num_rows = len(prompts) * n
        self.loop: DecodeLoop | None = None
        self.passes: list[PassRecord] = []
        self.held: list[list[int]] = []  # each row's tokens in the executor: prompt, turns, answers
        self.released: set[int] = set()
        self.started = self.closed = False
        self.pending = 0  # the session's pending entries after its last turn

    @torch.no_grad()
    def first(self) -> RolloutBatch:
        if self.started or self.closed:
            raise RlttError("ContinuedTurns.first: the first turn was sampled already (or the session is closed)")
        self.started = True
        start = time.perf_counter()
        params = self.params
        longest = max(len(p) for p in self.prompts)
        positions = min(longest + self.width, self.model.config.max_position_embeddings + 1)
        self.loop = DecodeLoop(self.model, self.num_rows, positions, params, self.policy, self.random, self.stops,
                               self.setup)
        prefill = seat_all(self.loop, self.prompts, params.n)
        run = self.loop.run(SeatAll(), [params.max_new_tokens] * self.num_rows, prefill)
        self.passes += run.schedule.passes
        index = [i for i in range(len(self.prompts)) for _ in range(params.n)]
        self.held = [list(self.prompts[i]) + run.rows[r].ids for r, i in enumerate(index)]
        return self._batch(self.prompts, index, list(range(self.num_rows)), run, params, True, start)

    @torch.no_grad()
    def next(self, rows: list[int], sequences: list[list[int]], caps: list[int],
             params: SamplingParams) -> RolloutBatch:
        start = time.perf_counter()
        loop = self._open()
        cfg = self.model.config
        params.validate(cfg.num_loops, cfg.vocab_size)
        if params.n != 1 or params.prompt_seeds is None or len(params.prompt_seeds) != len(rows):
            raise RlttError("ContinuedTurns.next: params need n=1 and prompt_seeds with one seed per continued row")
        for name in ("schedule", "temperature", "top_p", "top_k"):
            if getattr(params, name) != getattr(self.params, name):
                raise RlttError(f"SamplingParams.{name}: a continued row keeps its session's "
                                f"{getattr(self.params, name)!r}, got {getattr(params, name)!r}")
        if not (len(rows) == len(sequences) == len(caps)) or len(set(rows)) != len(rows):
            raise RlttError("ContinuedTurns.next: rows, sequences and caps need one entry per distinct row")
        sequences = check_prompts(sequences, cfg.vocab_size, cfg.max_position_embeddings)
        executor, sched = loop.executor, loop.sched
        for r, seq, cap in zip(rows, sequences, caps):
            held = self.held[r] if 0 <= r < self.num_rows else None
            if held is None or r in self.released:
                raise RlttError(f"ContinuedTurns.next: row {r} is not a live row of this session")
            if sched.active[r]:
                raise RlttError(f"ContinuedTurns.next: row {r} is still decoding")
            if seq[: len(held)] != held:
                raise RlttError(f"ContinuedTurns.next: row {r}'s sequence does not extend the tokens it holds")
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1 or len(seq) + cap > executor.max_len:
                raise RlttError(f"ContinuedTurns.next: row {r} has {len(seq)} positions and asks for {cap!r} more; "
                                f"the session holds {executor.max_len} (prompt + max_tokens)")
        device = executor.device
        for r, seq in zip(rows, sequences):
            appended = seq[len(self.held[r]):]
            if appended:
                executor.tokens[r, len(self.held[r]): len(seq)] = torch.tensor(appended, device=device)
            sched.resume(r, len(appended))
            self.held[r] = list(seq)
        # each continued row draws from its turn seed from now on
        loop.slot_random.rekey(list(rows), RowRandom(0, self.random.device, None, list(params.prompt_seeds), 1))
        loop.begin_all(list(rows), [len(seq) - 1 for seq in sequences])
        cap = [0] * self.num_rows
        for r, c in zip(rows, caps):
            cap[r] = c
        run = loop.run(SeatAll(), cap)
        self.passes += run.schedule.passes
        for r in rows:
            self.held[r] += run.rows[r].ids
        return self._batch(sequences, list(range(len(rows))), list(rows), run, params, False, start)

    def _open(self) -> DecodeLoop:
        if self.loop is None:
            raise RlttError("ContinuedTurns: no live rows (sample the first turn first; a closed session holds none)")
        return self.loop

    def _batch(self, prompts, prompt_index, rows, run, params, replayable, start) -> RolloutBatch:
        """The batch of ``rows`` (session rows, in order) from ``run``; row i completes ``prompts[prompt_index[i]]``."""
        stats = run.stats
        # pending entries are the session's state, not a turn's: each turn reports its change, so the
        # episode's sum over turns is the session's pending work at its end
        stats.entries_pending, self.pending = stats.entries_pending - self.pending, stats.entries_pending
        if len(rows) != self.num_rows:
            stats = replace(stats, row_passes=stats.row_passes[torch.tensor(rows, dtype=torch.long)])
        cfg = self.model.config
        batch = rows_batch(prompts, prompt_index, [run.rows[r] for r in rows],
                           schedule=Schedule(params.schedule, list(run.schedule.passes), replayable=replayable,
                                             attention=self.attention),
                           params=params, stats=stats, num_loops=cfg.num_loops,
                           dtype=self.model.lm_head.weight.dtype, pad_id=cfg.pad_token_id or 0)
        stats.wall_time = time.perf_counter() - start
        return batch

    def release(self, rows: list[int]) -> None:
        self.released.update(rows)
        if len(self.released) >= self.num_rows:
            self.loop = None  # every episode ended: the executor (KV cache) goes now

    def record(self) -> Schedule:
        return Schedule(self.params.schedule, list(self.passes), replayable=True, attention=self.attention)

    def close(self) -> None:
        self.loop = None
        self.closed = True

    def held_bytes(self) -> int:
        """Bytes of the KV cache the session keeps between turns (0 once released or closed)."""
        if self.loop is None:
            return 0
        cache = self.loop.executor.cache
        return sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
