"""The rows of a partial rollout (``orchestration.partial_rollouts``): rows generated in segments,
each segment at the newest weights version, stitched back into one `RolloutBatch` per group.

A row's first segment is sampled with its group (``n`` = group size, the group's prompt seed, as
a one-call rollout would); an unfinished row continues with its prompt and tokens so far as the
prompt of a one-row call (``n`` = 1, the seed `segment_seed`). The engine recomputes that
prefix's KV cache under the weights it serves now (as AReaL does): nothing engine-specific is
kept between segments, and every token's recorded log-probs, exit step, gates and kept set are
those of the call that sampled it — the behaviour policy of that token, exactly. ``versions``
records the weights version of each token.

A row ends when the engine stops it (a stop token, or a stop string — also one spanning two
segments, found here), at its cap (``max_new_tokens`` in all), or when the model's positions run out
(the engine returns fewer tokens than asked with finish reason ``length``).

A thinking budget (`ThinkingBudget`) counts the row's tokens across its segments: a row's segments
are cut so that one ends at ``budget`` tokens; there the forced-answer rule of every engine
(`ThinkingBudget.at_budget`) applies — the interruption appended as forced tokens (not sampled:
``forced_mask``, exit step 0, log-probs 0, no gates), then up to ``answer_budget`` more sampled
tokens in the following segments — or, thinking closed in time, on to ``max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from rltt.orchestration.prompt_stream import Task
from rltt.rollout import RolloutBatch, RolloutStats, SamplingParams
from rltt.rollout.params import ThinkingBudget
from rltt.rollout.rollout_batch import Schedule
from rltt.rollout.rows import Row, rows_batch

@dataclass
class PartialRow(Row):
    """One completion so far: the row record (every per-token field, the version of each token
    included, and the serial passes it took), its finish reason (None while generating), the
    segments it ran and its cap once a thinking budget's rule has set it (None: the budget, or
    ``max_new_tokens`` without one)."""

    segments: int = 0
    cap: int | None = None

    def limit(self, params: SamplingParams, thinking: ThinkingBudget | None = None) -> int:
        """The completion length the row samples to now."""
        if self.cap is not None:
            return self.cap
        return params.max_new_tokens if thinking is None else thinking.budget

    def append_segment(self, batch: RolloutBatch, r: int, version: int, asked: int, params: SamplingParams,
                       thinking: ThinkingBudget | None = None, positions: int | None = None) -> None:
        """Append row ``r`` of a segment's ``batch`` (sampled at ``version``, ``asked`` tokens at most)
        and decide whether the row has finished (``params``: the run's sampling settings, without a
        thinking budget; ``thinking``: the run's budget; ``positions``: the completion positions the
        model has after the row's prompt, None for unbounded)."""
        n = int(batch.completion_lengths[r])
        had = len(self)
        reason = batch.finish_reasons[r]
        if had and params.stop_strings:  # a stop string spanning the segments' boundary ends it there
            new = batch.completion_ids[r, :n].tolist()
            if params.stop_string_in(self.ids + new):
                old = self.ids
                n = next(k for k in range(1, n + 1) if params.stop_string_in(old + new[:k]))
                reason = "stop"
        self.take(batch, r, n, versions=version)
        if batch.stats.row_passes is not None:
            self.passes = (self.passes or 0.0) + float(batch.stats.row_passes[r])
        self.segments += 1
        if reason == "stop":
            self.finish = "stop"
            return
        if n < asked:  # the model's positions ran out
            self.finish = "length"
            return
        if thinking is not None and self.cap is None and len(self) == thinking.budget:
            # the forced-answer rule (room: the positions left, counting the next sampled token's, as the engines do)
            room = positions - len(self) + 1 if positions is not None else 1 << 62
            then = thinking.at_budget(self.ids, params.max_new_tokens, room)
            if then is None:
                self.finish = "length"
                return
            ids, self.cap = then
            if ids:  # forced, not sampled: no gates computed for them
                self.force(ids, batch.num_loops, versions=version)
        if len(self) >= self.limit(params, thinking):
            self.finish = "length"

    def versions_spanned(self) -> int:
        v = self.values["versions"]
        return max(v) - min(v) + 1 if len(v) else 0

    def plain(self) -> dict:
        return {**super().plain(), "segments": self.segments, "cap": self.cap}

    @classmethod
    def from_plain(cls, plain: dict) -> "PartialRow":
        row = cls(segments=plain["segments"], cap=plain.get("cap")).load(plain)
        if row.passes is None:
            row.passes = 0.0
        return row


@dataclass
class Group:
    """The ``n`` rows of one prompt: its task (with its stream position ``task.index``), admission
    order ``index``, prompt seed, the version its first segment was sampled at (None before it) and
    its rows (none before the first segment)."""

    index: int
    task: Task
    seed: int
    first_version: int | None = None
    rows: list[PartialRow] = field(default_factory=list)

    @property
    def started(self) -> bool:
        return bool(self.rows)

    @property
    def done(self) -> bool:
        return self.started and all(row.finish is not None for row in self.rows)

    def oldest_version(self) -> int | None:
        """The version of the group's oldest token (its first segment's)."""
        return self.first_version

    def plain(self) -> dict:
        t = self.task
        return {"index": self.index, "seed": self.seed, "first_version": self.first_version,
                "task": {"id": t.id, "prompt": t.prompt, "prompt_ids": list(t.prompt_ids), "answer": t.answer,
                         "index": t.index},
                "rows": [row.plain() for row in self.rows]}

    @classmethod
    def from_plain(cls, plain: dict) -> "Group":
        return cls(plain["index"], Task(**plain["task"]), plain["seed"], plain["first_version"],
                   [PartialRow.from_plain(r) for r in plain["rows"]])


def group_batch(group: Group, params: SamplingParams, num_loops: int, dtype: torch.dtype, pad_id: int,
                kind: str) -> RolloutBatch:
    """The group's finished rows as one `RolloutBatch` (one prompt, ``params.n`` rows). Its schedule
    has no passes and is not replayable: the rows' segments ran under different calls (and
    possibly weights)."""
    rows = group.rows
    counted = all(row.segments for row in rows)
    stats = RolloutStats(passes=0, row_passes=torch.tensor([row.passes or 0.0 for row in rows]) if counted else None,
                         tokens=sum(len(row) for row in rows))
    return rows_batch([list(group.task.prompt_ids)], [0] * len(rows), rows,
                      schedule=Schedule(kind, [], replayable=False),
                      params=replace(params, prompt_seeds=[group.seed], n=len(rows)), stats=stats,
                      num_loops=num_loops, dtype=dtype, pad_id=pad_id)
