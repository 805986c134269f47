"""Completion rows into a `RolloutBatch`: what every rollout engine records per row, laid out once.

While decoding, an engine keeps one `CompletedRow` per row: its completion tokens with each
token's exit step, sampler log-probs (raw and tempered) and kept-set floor (top-k/top-p), which tokens were forced (the
interruption of a thinking budget, `SamplingParams.thinking`) and its finish reason.
`completion_batch` pads the rows into a `RolloutBatch`. What stays with an engine is what only it
has: its pass schedule (the native engine's replayable record; vLLM has none), where its gate
values live, and its `RolloutStats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from rltt.rollout.params import SamplingParams
from rltt.rollout.rollout_batch import RolloutBatch, RolloutStats, Schedule

__all__ = ["CompletedRow", "completion_batch"]

#: ``gates(r, n)``: the (T, n) fp32 gate values λ_t of the states that produced row r's n
#: completion tokens, NaN where a step was not computed
Gates = Callable[[int, int], torch.Tensor]


@dataclass
class CompletedRow:
    """One completion row as an engine records it while decoding.

    Per completion token: ``tokens``, ``exits`` (its exit step t*, 0 for a forced token), ``raw``
    and ``tempered`` (its sampler log-probs as Python floats — exact fp32 values — 0.0 for a forced
    token), ``floors`` (the kept-set floor of top-k/top-p, `rltt.rollout.sampler.kept_floor`; -1 when
    nothing was truncated and for a forced token); ``forced`` the completion indices of forced
    tokens; ``finish`` ``"stop"`` or ``"length"``."""

    tokens: list[int] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    tempered: list[float] = field(default_factory=list)
    floors: list[int] = field(default_factory=list)
    forced: list[int] = field(default_factory=list)
    finish: str = "length"

    def add(self, token: int, exit_step: int, raw: float, tempered: float, floor: int = -1) -> None:
        """Append one sampled token."""
        self.tokens.append(token)
        self.exits.append(exit_step)
        self.raw.append(raw)
        self.tempered.append(tempered)
        self.floors.append(floor)

    def extend(self, tokens: Sequence[int], exits: Sequence[int], raw: Sequence[float],
               tempered: Sequence[float], floors: Sequence[int] | None = None) -> None:
        """Append sampled tokens (one entry per token in each list; ``floors`` None: nothing truncated)."""
        self.tokens += tokens
        self.exits += exits
        self.raw += raw
        self.tempered += tempered
        self.floors += [-1] * len(tokens) if floors is None else floors

    def force(self, tokens: Sequence[int]) -> None:
        """Append forced (not sampled) tokens: no exit step, no sampling log-prob."""
        for token in tokens:
            self.forced.append(len(self.tokens))
            self.add(token, 0, 0.0, 0.0)


def completion_batch(prompts: list[list[int]], prompt_index: list[int], rows: Sequence[CompletedRow], *,
                     schedule: Schedule, params: SamplingParams, stats: RolloutStats, num_loops: int,
                     dtype: torch.dtype, pad_id: int, gates: Gates | None = None) -> RolloutBatch:
    """The `RolloutBatch` of ``rows`` (row r completes ``prompts[prompt_index[r]]``).

    Completion-indexed tensors are right-padded to the longest completion (at least one column):
    ids with ``pad_id``, exit steps and log-probs with 0, kept-set floors with -1, ``forced_mask`` False; ``gate_probs``
    (T, R, C) holds ``gates(r, n)`` for row r's n tokens and NaN elsewhere (all NaN without
    ``gates``). ``schedule``, ``params`` (seed filled in), ``stats`` and ``dtype`` are the engine's."""
    num_rows = len(rows)
    width = max(1, max((len(row.tokens) for row in rows), default=0))
    ids = torch.full((num_rows, width), pad_id, dtype=torch.long)
    exits = torch.zeros((num_rows, width), dtype=torch.long)
    raw = torch.zeros((num_rows, width), dtype=torch.float32)
    tempered = torch.zeros((num_rows, width), dtype=torch.float32)
    floors = torch.full((num_rows, width), -1, dtype=torch.long)
    gate_probs = torch.full((num_loops, num_rows, width), float("nan"))
    forced = torch.zeros((num_rows, width), dtype=torch.bool)
    for r, row in enumerate(rows):
        n = len(row.tokens)
        if n == 0:
            continue
        ids[r, :n] = torch.tensor(row.tokens)
        exits[r, :n] = torch.tensor(row.exits)
        # float() of an fp32 value and back is exact, so these are the sampler's bits
        raw[r, :n] = torch.tensor(row.raw, dtype=torch.float32)
        tempered[r, :n] = torch.tensor(row.tempered, dtype=torch.float32)
        floors[r, :n] = torch.tensor(row.floors, dtype=torch.long)
        if gates is not None:
            gate_probs[:, r, :n] = gates(r, n)
        forced[r, row.forced] = True
    lengths = torch.tensor([len(row.tokens) for row in rows], dtype=torch.long)
    return RolloutBatch(
        prompts=prompts, prompt_index=torch.tensor(prompt_index, dtype=torch.long),
        prompt_lengths=torch.tensor([len(prompts[i]) for i in prompt_index], dtype=torch.long),
        completion_ids=ids, completion_lengths=lengths,
        completion_mask=torch.arange(width)[None, :] < lengths[:, None],
        exit_steps=exits, logprobs=raw, tempered_logprobs=tempered, gate_probs=gate_probs,
        finish_reasons=[row.finish for row in rows], schedule=schedule, params=params, stats=stats,
        num_loops=num_loops, dtype=dtype, pad_id=pad_id, forced_mask=forced, kept_floor=floors,
    )
