"""What a rollout returns: `RolloutBatch` (tokens, exits, log-probs, schedule) and `RolloutStats`.

Layout: one *row* per completion (``n`` rows per prompt, prompt-major). Completion-indexed
tensors are right-padded to ``C = max completion length`` and come with ``completion_lengths``
and ``completion_mask``; step-indexed tensors have the step axis first (T, R, C), as in
`rltt.model.LoopOutput`. Steps are 1-based.

The schedule record (docs/design.md §2.5) lists, for every serial pass of the shared block, the work it
did: for each row, the contiguous range of positions ``start..end`` it computed at one step
(``end`` is the row's decode token; ``start < end`` means pending entries of earlier tokens —
or the prompt — were computed in the same pass), and which rows' decode tokens exited (were
sampled) after that pass. Positions count from the row's first prompt token; the token at
position ``p ≥ P − 1`` (P = prompt length) produces completion token ``p − P + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from rltt.model.exits import exit_logprob
from rltt.rollout.attention import DEFAULT_ATTENTION
from rltt.rollout.params import SamplingParams


@dataclass
class PassRecord:
    """One serial pass of the shared block over a depth-mixed batch of work items.

    ``work`` (n, 4) int64 rows of ``[row, start, end, step]``: row ``row`` computed step ``step``
    for positions ``start..end`` (sorted by (step, row)); ``exits`` (k,) the rows whose decode
    token (position ``end``) was sampled from this pass's step, in head order. ``fork`` (f, 3)
    rows of ``[src, dst, length]``, set on the last pass of a shared prompt prefill: after the
    pass, row ``dst`` receives row ``src``'s computed state (KV entries of every step, carries,
    gates) of positions ``0..length-1`` — the rows of one prompt share its prefill.

    ``admit`` (m, 4) rows of ``[slot, row, src, length]``, only in a continuous-batching record
    (`rltt.rollout.admission.Continuous`): *before* the pass, in order, slot ``slot`` starts holding the batch's
    row ``row`` (`PassExecutor.admit`: the state of positions ``0..length-1`` from slot ``src`` when
    ``src ≥ 0``). In such a record ``work`` rows, ``exits`` and ``fork`` name slots, not batch rows.
    """

    work: torch.Tensor
    exits: torch.Tensor
    fork: torch.Tensor | None = None
    admit: torch.Tensor | None = None

    def entries(self) -> int:
        """(token, step) entries this pass computed."""
        return int((self.work[:, 2] - self.work[:, 1] + 1).sum())

    def offset(self, rows: int) -> "PassRecord":
        """The same pass with every row index moved by ``rows`` (a record placed after ``rows``
        rows of others); the record itself when ``rows`` is 0."""
        if not rows:
            return self
        work = self.work.clone()
        work[:, 0] += rows
        fork = admit = None
        if self.fork is not None:
            fork = self.fork.clone()
            fork[:, :2] += rows
        if self.admit is not None:  # slots, rows and sources all move (src −1: none)
            admit = self.admit.clone()
            admit[:, :2] += rows
            admit[:, 2] = torch.where(admit[:, 2] >= 0, admit[:, 2] + rows, admit[:, 2])
        return PassRecord(work=work, exits=self.exits + rows, fork=fork, admit=admit)


@dataclass
class Schedule:
    """The record of a rollout: schedule kind and every pass in order.

    ``replayable``: set by what recorded it — True when ``passes`` is the complete pass record
    `replay_logprobs` can re-execute (the native engine's), False when the engine has none (vLLM
    batches requests its own way: no passes). Defaults to False, so a record nobody vouched for is
    never replayed.

    ``chunks``: None when one batch of all rows ran every pass; else ``(rows, passes)`` per
    *chunk*, in order — the rows were sampled in separate batches (a native engine's
    ``chunk_rows``, a Ray pool's shards): chunk k holds the next ``rows`` rows and ran the next
    ``passes`` passes over them alone. Row indices in ``passes`` are always the batch's. Replay
    re-executes each chunk on its own rows, the batch composition the rollout had
    (`chunk_spans`, `join_schedules`).

    Pickled (a Ray rollout worker returning its batch), the passes travel as a few flat
    tensors — every pass's ``work`` rows concatenated with per-pass row counts, likewise the
    exits, and the forks with the index of their pass — and are rebuilt on load: a step's ~200
    passes of two or three small tensors each cost far more to pickle one by one than their
    data. The rebuilt passes equal the originals (dtypes, values, ``fork`` None or a tensor).

    ``attention``: the attention implementation the passes ran with (`rltt.rollout.attention`:
    ``sdpa``, ``triton``); replay runs them with the same one, since the two round differently.
    """

    kind: str
    passes: list[PassRecord] = field(default_factory=list)
    replayable: bool = False
    chunks: list[tuple[int, int]] | None = None
    attention: str = DEFAULT_ATTENTION

    def chunk_sizes(self, num_rows: int) -> list[tuple[int, int]]:
        """``(rows, passes)`` per chunk; one chunk of every row and pass when ``chunks`` is None."""
        return [(num_rows, len(self.passes))] if self.chunks is None else list(self.chunks)

    def chunk_spans(self, num_rows: int) -> list[tuple[int, int, int, int]]:
        """``(first_row, end_row, first_pass, end_pass)`` per chunk: the rows it holds and the passes
        it ran (half-open ranges). Raises ValueError when the chunks do not cover ``num_rows`` rows
        and every pass."""
        spans, row, index = [], 0, 0
        for rows, passes in self.chunk_sizes(num_rows):
            spans.append((row, row + rows, index, index + passes))
            row, index = row + rows, index + passes
        if row != num_rows or index != len(self.passes):
            raise ValueError(f"Schedule: chunks cover {row} rows and {index} passes, the record has "
                             f"{num_rows} rows and {len(self.passes)} passes")
        return spans

    def __getstate__(self) -> dict:
        passes = self.passes
        forked = [i for i, p in enumerate(passes) if p.fork is not None]
        admitted = [i for i, p in enumerate(passes) if p.admit is not None]
        flat = {"kind": self.kind, "replayable": self.replayable, "passes": len(passes),
                "fork_pass": torch.tensor(forked, dtype=torch.long), "chunks": self.chunks,
                "attention": self.attention, "admit_pass": torch.tensor(admitted, dtype=torch.long)}
        for name, records in (("work", [p.work for p in passes]), ("exits", [p.exits for p in passes]),
                              ("fork", [passes[i].fork for i in forked]),
                              ("admit", [passes[i].admit for i in admitted])):
            if not _packable(records):  # odd shapes or mixed dtypes: pickled pass by pass
                return {"kind": self.kind, "replayable": self.replayable, "passes": list(passes),
                        "chunks": self.chunks, "attention": self.attention}
            flat[name] = _narrow(torch.cat(records)) if records else None
            flat[f"{name}_dtype"] = records[0].dtype if records else None
            flat[f"{name}_counts"] = torch.tensor([len(t) for t in records], dtype=torch.long)
        return flat

    def __setstate__(self, state: dict) -> None:
        self.kind = state["kind"]
        self.replayable = state["replayable"]
        self.chunks = state.get("chunks")
        self.attention = state.get("attention", DEFAULT_ATTENTION)
        if isinstance(state["passes"], list):
            self.passes = state["passes"]
            return

        def pieces(name: str) -> list[torch.Tensor]:
            if state[name] is None:
                return []
            return list(torch.split(state[name].to(state[f"{name}_dtype"]), state[f"{name}_counts"].tolist()))

        forks = dict(zip(state["fork_pass"].tolist(), pieces("fork")))
        admits = dict(zip(state["admit_pass"].tolist(), pieces("admit"))) if "admit_pass" in state else {}
        self.passes = [PassRecord(work=w, exits=e, fork=forks.get(i), admit=admits.get(i))
                       for i, (w, e) in enumerate(zip(pieces("work"), pieces("exits")))]
        if len(self.passes) != state["passes"]:
            raise ValueError(f"Schedule: {len(self.passes)} passes rebuilt, {state['passes']} pickled")


def join_schedules(parts: Sequence[Schedule], rows: Sequence[int]) -> Schedule:
    """One record of batches sampled apart: ``parts[k]`` recorded ``rows[k]`` rows, placed after
    the rows of the parts before it. Passes are listed part after part with their rows renumbered,
    and ``chunks`` keeps each part's chunks (a part without any is one chunk), so replay runs
    every chunk on the rows it ran with. One part is returned as it is. The parts must share one
    attention implementation (the record has one)."""
    if len(parts) == 1:
        return parts[0]
    attention = {p.attention for p in parts}
    if len(attention) > 1:
        raise ValueError(f"join_schedules: parts ran different attention implementations {sorted(attention)}")
    passes: list[PassRecord] = []
    chunks: list[tuple[int, int]] = []
    offset = 0
    for schedule, count in zip(parts, rows, strict=True):
        passes.extend(record.offset(offset) for record in schedule.passes)
        chunks.extend(schedule.chunk_sizes(count))
        offset += count
    return Schedule(parts[0].kind, passes, replayable=all(p.replayable for p in parts), chunks=chunks,
                    attention=parts[0].attention)


def _pad(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """``t`` right-padded with ``value`` to ``width`` along its last axis."""
    if t.shape[-1] == width:
        return t
    return torch.cat([t, torch.full((*t.shape[:-1], width - t.shape[-1]), value, dtype=t.dtype)], dim=-1)


def join_batches(parts: Sequence["RolloutBatch"], params: SamplingParams, stats: "RolloutStats") -> "RolloutBatch":
    """One batch of batches sampled apart (a Ray pool's shards), their rows in order: every per-token
    field (`TOKEN_FIELDS`) padded to the widest part and stacked, an optional one (``versions``) only
    when every part recorded it; the schedules joined (`join_schedules`: replay runs each part on its
    own rows). ``params``: the call's (with the seed the parts used); ``stats``: the joined work. One
    part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    width = max(p.completion_ids.shape[1] for p in parts)
    prompts, index = [], []
    for p in parts:
        index.append(p.prompt_index + len(prompts))
        prompts.extend(p.prompts)
    columns = {}
    for f in TOKEN_FIELDS:
        tensors = [getattr(p, f.name) for p in parts]
        if any(t is None for t in tensors):
            columns[f.name] = None
            continue
        pad = first.pad_id if f.pad is None else f.pad
        columns[f.name] = torch.cat([_pad(t, width, pad) for t in tensors], dim=1 if f.loops else 0)
    lengths = torch.cat([p.completion_lengths for p in parts])
    return RolloutBatch(
        prompts=prompts, prompt_index=torch.cat(index), prompt_lengths=torch.cat([p.prompt_lengths for p in parts]),
        completion_lengths=lengths, completion_mask=torch.arange(width)[None, :] < lengths[:, None],
        finish_reasons=[f for p in parts for f in p.finish_reasons],
        schedule=join_schedules([p.schedule for p in parts], [p.num_rows for p in parts]), params=params,
        stats=stats, num_loops=first.num_loops, dtype=first.dtype, pad_id=first.pad_id, **columns)


def _packable(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` concatenate along dim 0 and split back into equal tensors."""
    if not tensors:
        return True
    first = tensors[0]
    return all(t.dim() == first.dim() >= 1 and t.dtype == first.dtype and t.shape[1:] == first.shape[1:]
               and t.device == first.device and not t.requires_grad for t in tensors)


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the narrowest integer dtype that holds its values (row indices, positions and
    steps are small): the transport form only, converted back exactly on load."""
    if t.dtype not in (torch.int64, torch.int32) or not t.numel():
        return t
    lo, hi = int(t.min()), int(t.max())
    for dtype in (torch.int8, torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return t.to(dtype)
    return t


@dataclass
class RolloutStats:
    """Work done by one `generate` call.

    - ``passes``: serial passes of the shared block over the whole batch (depth-mixed: a pass
      advances every active row by one step).
    - ``row_passes`` (R,): serial passes each row took part in (its own decode latency in passes).
    - ``entries_computed``: (token, step) entries computed (prompt entries included).
    - ``entries_pending``: entries of processed tokens left uncomputed at the end (deferred work
      no later token needed).
    - ``tokens``: completion tokens generated; ``wall_time`` seconds.
    - ``occupied``: the sum over passes of the pass's live rows (rows with work in it) over the
      engine's row bound (``chunk_rows``, or the call's rows without it), ``occupied_passes`` the
      passes summed; ``waiting_occupied`` / ``waiting_passes`` the same over the passes during which
      rows of the call were still waiting to start (`occupancy`, `occupancy_waiting`).
    """

    passes: int = 0
    row_passes: torch.Tensor | None = None
    entries_computed: int = 0
    entries_pending: int = 0
    tokens: int = 0
    wall_time: float = 0.0
    occupied: float = 0.0
    occupied_passes: int = 0
    waiting_occupied: float = 0.0
    waiting_passes: int = 0

    @property
    def occupancy(self) -> float | None:
        """Live rows per pass over the row bound, averaged over the passes (None: no passes counted)."""
        return self.occupied / self.occupied_passes if self.occupied_passes else None

    @property
    def occupancy_waiting(self) -> float | None:
        """`occupancy` over the passes during which rows were still waiting to start (None: none were)."""
        return self.waiting_occupied / self.waiting_passes if self.waiting_passes else None

    @staticmethod
    def join(parts: Sequence["RolloutStats"], serial: bool, wall_time: float) -> "RolloutStats":
        """The work of batches sampled apart, in row order: ``serial`` (one after another, a native
        engine's chunks) adds their serial passes, otherwise (side by side, a Ray pool's shards)
        the slowest one's count. ``row_passes`` is None unless every part counted them."""
        counted = [p.row_passes for p in parts if p.row_passes is not None]
        passes = [p.passes for p in parts]
        return RolloutStats(passes=sum(passes) if serial else max(passes),
                            row_passes=torch.cat(counted) if len(counted) == len(parts) else None,
                            entries_computed=sum(p.entries_computed for p in parts),
                            entries_pending=sum(p.entries_pending for p in parts),
                            tokens=sum(p.tokens for p in parts), wall_time=wall_time,
                            # every part's passes count, each against its own row bound
                            occupied=sum(p.occupied for p in parts),
                            occupied_passes=sum(p.occupied_passes for p in parts),
                            waiting_occupied=sum(p.waiting_occupied for p in parts),
                            waiting_passes=sum(p.waiting_passes for p in parts))

    @property
    def passes_per_token(self) -> float:
        """Serial block passes per generated token, averaged over rows' tokens."""
        if self.row_passes is None or not self.tokens:
            return 0.0
        return float(self.row_passes.sum()) / self.tokens


@dataclass(frozen=True)
class TokenField:
    """One per-token field of a rollout: a `RolloutBatch` attribute of shape (R, C) — (T, R, C) with
    ``loops`` — and how every row record (`rltt.rollout.rows.Row`) holds and pads it.

    ``code``: the `array` typecode a row keeps it in (``q`` int64, ``f`` fp32, ``B`` bool), so a
    row's host bytes per token are the batch's; ``pad``: the value on padding (None: the batch's
    ``pad_id``); ``unsampled``: the value on a token the policy did not sample (forced by a thinking
    budget, or written by the environment); ``loops``: one value per loop step (the gates);
    ``optional``: the batch holds None when no row recorded it (a one-version rollout has no
    ``versions``); ``derived``: a row may leave it unknown (NaN) and the batch computes it from the
    other fields (the exit log-prob from the gates, `RolloutBatch.__post_init__`)."""

    name: str
    code: str
    dtype: torch.dtype
    pad: float | int | bool | None
    unsampled: float | int | bool | None
    loops: bool = False
    optional: bool = False
    derived: bool = False


#: Every per-token field of a rollout, in `RolloutBatch`'s order. Adding a per-token field is one
#: entry here and its `RolloutBatch` attribute: every row record, the batch builder
#: (`rltt.rollout.rows.rows_batch`), the join (`join_batches`), a partial rollout's buffer and its
#: checkpoint form, and the memory plan's count of that buffer follow this table.
TOKEN_FIELDS: tuple[TokenField, ...] = (
    TokenField("completion_ids", "q", torch.long, None, None),
    TokenField("exit_steps", "q", torch.long, 0, 0),
    TokenField("logprobs", "f", torch.float32, 0.0, 0.0),
    TokenField("tempered_logprobs", "f", torch.float32, 0.0, 0.0),
    TokenField("gate_probs", "f", torch.float32, float("nan"), float("nan"), loops=True),
    TokenField("forced_mask", "B", torch.bool, False, False),
    TokenField("kept_floor", "q", torch.long, -1, -1),
    TokenField("exit_logprobs", "f", torch.float32, 0.0, 0.0, derived=True),
    TokenField("env_mask", "B", torch.bool, False, False),
    TokenField("versions", "q", torch.long, -1, -1, optional=True),
)


@dataclass
class RolloutBatch:
    """Completions of one `generate` call with everything needed to replay them exactly.

    Per row r (R = len(prompts) · n rows), with C the longest completion:

    - ``prompts``: the prompts as given; ``prompt_index`` (R,) which prompt row r completes;
      ``prompt_lengths`` (R,).
    - ``completion_ids`` (R, C) int64, right-padded with ``pad_id``; ``completion_lengths`` (R,);
      ``completion_mask`` (R, C) bool.
    - ``exit_steps`` (R, C) int64: t* of each completion token (0 on padding).
    - ``logprobs`` (R, C) fp32: ``log P^(t*)(y)`` of the raw logits (before temperature and
      truncation); ``tempered_logprobs`` (R, C) fp32: of the distribution the token was drawn
      from, ``softmax(logits / temperature)`` renormalised over the kept set of top-k/top-p
      (equal to ``logprobs`` for greedy, temperature 0). 0 on padding.
    - ``kept_floor`` (R, C) int64: the kept set of top-k/top-p each token was drawn from, as the
      id of its lowest-scoring kept token b (the set is ``{i : ℓ_i/τ ≥ ℓ_b/τ}`` of the exit step's
      logits, `rltt.rollout.sampler.kept_floor`); -1 where nothing was truncated, on padding and
      on forced tokens. All -1 when not given (no truncation).
    - ``gate_probs`` (T, R, C) fp32: λ_t of the state that produced each completion token,
      NaN where step t of that token was never computed (deferred) or on padding.
    - ``exit_logprobs`` (R, C) fp32: ``log p_{t*}``, the log-probability of each sampled token's
      exit step under the survival exit distribution of its state's gates
      (`rltt.model.exits.exit_logprob`; only λ_1..λ_{t*} enter), 0 on padding and forced tokens —
      the exit half of the action (t*, y) (docs/design.md §5.12). Computed from ``gate_probs`` when
      not given.
    - ``versions`` (R, C) int64: the weights version that sampled each completion token (-1 on
      padding); rows of a partial rollout (``orchestration.partial_rollouts``) mix versions, each
      token's log-probs being those of the policy that sampled it. None: not recorded (one call,
      one version).
    - ``finish_reasons``: ``"stop"`` (stop token or string) or ``"length"`` (max_new_tokens or
      the model's max_position_embeddings) per row.
    - ``schedule``: the pass record (see the module docstring); ``params``: the sampling
      parameters, with ``seed`` filled in; ``dtype``: the model dtype the rollout ran in.
    - ``forced_mask`` (R, C) bool: completion tokens that were *forced*, not sampled (the
      interruption of a thinking budget, `SamplingParams.thinking`): input for the tokens after
      them, never policy actions. Their ``logprobs``/``tempered_logprobs`` are 0, ``exit_steps``
      0 (no exit was decided) and ``gate_probs`` those of the state before them, as computed.
      All False when nothing was forced (the default).
    - ``env_mask`` (R, C) bool: completion tokens the *environment* wrote in a multi-turn episode
      (tool results, user messages; `rltt.orchestration.episodes`): context the model attends to
      at its next turn, never policy actions — ``logprobs``/``tempered_logprobs`` 0, ``exit_steps``
      0, ``gate_probs`` NaN. All False for a single-turn rollout (the default).
    """

    prompts: list[list[int]]
    prompt_index: torch.Tensor
    prompt_lengths: torch.Tensor
    completion_ids: torch.Tensor
    completion_lengths: torch.Tensor
    completion_mask: torch.Tensor
    exit_steps: torch.Tensor
    logprobs: torch.Tensor
    tempered_logprobs: torch.Tensor
    gate_probs: torch.Tensor
    finish_reasons: list[str]
    schedule: Schedule
    params: SamplingParams
    stats: RolloutStats
    num_loops: int
    dtype: torch.dtype
    pad_id: int = 0
    forced_mask: torch.Tensor | None = None
    kept_floor: torch.Tensor | None = None
    exit_logprobs: torch.Tensor | None = None
    env_mask: torch.Tensor | None = None
    versions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.forced_mask is None:
            self.forced_mask = torch.zeros(self.completion_ids.shape, dtype=torch.bool)
        if self.env_mask is None:
            self.env_mask = torch.zeros(self.completion_ids.shape, dtype=torch.bool)
        if self.kept_floor is None:
            self.kept_floor = torch.full(self.completion_ids.shape, -1, dtype=torch.long)
        if self.exit_logprobs is None:
            self.exit_logprobs = exit_logprob(self.gate_probs, self.exit_steps, self.action_mask).cpu()

    @property
    def action_mask(self) -> torch.Tensor:
        """(R, C) bool: the sampled completion tokens (the policy's actions): completion, neither
        forced nor written by the environment."""
        return self.completion_mask & ~self.forced_mask & ~self.env_mask

    @property
    def num_rows(self) -> int:
        return int(self.prompt_index.shape[0])

    def completion(self, row: int) -> list[int]:
        return self.completion_ids[row, : int(self.completion_lengths[row])].tolist()

    def sequence(self, row: int) -> list[int]:
        """Prompt + completion token ids of ``row``."""
        return list(self.prompts[int(self.prompt_index[row])]) + self.completion(row)

    def sequences(self) -> list[list[int]]:
        return [self.sequence(r) for r in range(self.num_rows)]

    def padded_sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded prompt + completion ``(input_ids (R, S), attention_mask (R, S), start (R,))``
        for a learner forward; ``start[r]`` is the position of row r's first completion token."""
        seqs = self.sequences()
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, seq in enumerate(seqs):
            ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[r, : len(seq)] = 1
        return ids, mask, self.prompt_lengths.clone()
