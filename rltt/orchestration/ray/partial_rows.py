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
from rltt.orchestration.step import rollout_seed
from rltt.rollout import RolloutBatch, RolloutStats, SamplingParams
from rltt.rollout.params import ThinkingBudget
from rltt.rollout.rollout_batch import Schedule

#: (name, dtype) of a row's per-token tensors, as `RolloutBatch` holds them.
TOKEN_FIELDS = (("completion_ids", torch.long), ("exit_steps", torch.long), ("logprobs", torch.float32),
                ("tempered_logprobs", torch.float32), ("exit_logprobs", torch.float32),
                ("kept_floor", torch.long), ("versions", torch.long), ("forced_mask", torch.bool))
PAD = {"completion_ids": None, "exit_steps": 0, "logprobs": 0.0, "tempered_logprobs": 0.0, "exit_logprobs": 0.0,
       "kept_floor": -1, "versions": -1, "forced_mask": False}


def token_bytes(loops: int) -> int:
    """Host bytes a row holds per completion token: its `TOKEN_FIELDS` and its ``loops`` gates (fp32);
    the memory plan's count is `rltt.planning.partial_buffer.PartialBuffer.per_token`."""
    return sum(torch.empty(0, dtype=dtype).element_size() for _, dtype in TOKEN_FIELDS) + 4 * loops


def segment_seed(seed: int, sample: int, segment: int) -> int:
    """The prompt seed of segment ``segment`` (≥ 1) of sample ``sample`` of a group seeded ``seed``."""
    return rollout_seed(seed, sample, segment, -2)


@dataclass
class Row:
    """One completion so far: per-token tensors (`TOKEN_FIELDS`), the gates (T, L), the serial
    passes it took, its finish reason (None while generating), the segments it ran and its cap once
    a thinking budget's rule has set it (None: the budget, or ``max_new_tokens`` without one)."""

    tokens: dict[str, torch.Tensor]
    gates: torch.Tensor
    passes: float = 0.0
    finish: str | None = None
    segments: int = 0
    cap: int | None = None

    @classmethod
    def empty(cls, loops: int) -> "Row":
        return cls({name: torch.zeros(0, dtype=dtype) for name, dtype in TOKEN_FIELDS},
                   torch.zeros((loops, 0), dtype=torch.float32))

    def __len__(self) -> int:
        return int(self.tokens["completion_ids"].shape[0])

    @property
    def ids(self) -> list[int]:
        return self.tokens["completion_ids"].tolist()

    def limit(self, params: SamplingParams, thinking: ThinkingBudget | None = None) -> int:
        """The completion length the row samples to now."""
        if self.cap is not None:
            return self.cap
        return params.max_new_tokens if thinking is None else thinking.budget

    def extend(self, batch: RolloutBatch, r: int, version: int, asked: int, params: SamplingParams,
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
        piece = {"completion_ids": batch.completion_ids[r, :n], "exit_steps": batch.exit_steps[r, :n],
                 "logprobs": batch.logprobs[r, :n], "tempered_logprobs": batch.tempered_logprobs[r, :n],
                 "exit_logprobs": batch.exit_logprobs[r, :n], "kept_floor": batch.kept_floor[r, :n],
                 "versions": torch.full((n,), version, dtype=torch.long),
                 "forced_mask": torch.zeros(n, dtype=torch.bool)}
        self.tokens = {name: torch.cat([self.tokens[name], piece[name].to(dtype).cpu()])
                       for name, dtype in TOKEN_FIELDS}
        self.gates = torch.cat([self.gates, batch.gate_probs[:, r, :n].float().cpu()], dim=1)
        if batch.stats.row_passes is not None:
            self.passes += float(batch.stats.row_passes[r])
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
            self.force(ids, version)
        if len(self) >= self.limit(params, thinking):
            self.finish = "length"

    def force(self, ids: list[int], version: int) -> None:
        """Append forced (not sampled) tokens: exit step 0, log-probs 0, no gates."""
        k = len(ids)
        if not k:
            return
        piece = {"completion_ids": torch.tensor(ids, dtype=torch.long), "kept_floor": torch.full((k,), -1),
                 "versions": torch.full((k,), version), "forced_mask": torch.ones(k, dtype=torch.bool)}
        self.tokens = {name: torch.cat([self.tokens[name], piece.get(name, torch.zeros(k)).to(dtype)])
                       for name, dtype in TOKEN_FIELDS}
        self.gates = torch.cat([self.gates, torch.full((self.gates.shape[0], k), float("nan"))], dim=1)

    def nbytes(self) -> int:
        """Bytes of the row's tensors (`token_bytes` per token)."""
        return sum(v.numel() * v.element_size() for v in self.tokens.values()) + \
            self.gates.numel() * self.gates.element_size()

    def versions_spanned(self) -> int:
        v = self.tokens["versions"]
        return int(v.max() - v.min()) + 1 if v.numel() else 0

    def plain(self) -> dict:
        return {"tokens": dict(self.tokens), "gates": self.gates, "passes": self.passes, "finish": self.finish,
                "segments": self.segments, "cap": self.cap}

    @classmethod
    def from_plain(cls, plain: dict) -> "Row":
        tokens = dict(plain["tokens"])
        tokens.setdefault("forced_mask", torch.zeros_like(tokens["completion_ids"], dtype=torch.bool))
        return cls(tokens, plain["gates"], plain["passes"], plain["finish"], plain["segments"], plain.get("cap"))


@dataclass
class Group:
    """The ``n`` rows of one prompt: its task (with its stream position ``task.index``), admission
    order ``index``, prompt seed, the version its first segment was sampled at (None before it) and
    its rows (none before the first segment)."""

    index: int
    task: Task
    seed: int
    first_version: int | None = None
    rows: list[Row] = field(default_factory=list)

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
                   [Row.from_plain(r) for r in plain["rows"]])


def group_batch(group: Group, params: SamplingParams, num_loops: int, dtype: torch.dtype, pad_id: int,
                kind: str) -> RolloutBatch:
    """The group's finished rows as one `RolloutBatch` (one prompt, ``params.n`` rows). Its schedule
    has no passes and is not replayable: the rows' segments ran under different calls (and
    possibly weights)."""
    rows = group.rows
    width = max(1, max(len(row) for row in rows))

    def stack(name: str, value) -> torch.Tensor:
        out = torch.full((len(rows), width), value, dtype=rows[0].tokens[name].dtype)
        for i, row in enumerate(rows):
            out[i, :len(row)] = row.tokens[name]
        return out

    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    gates = torch.full((num_loops, len(rows), width), float("nan"))
    for i, row in enumerate(rows):
        gates[:, i, :len(row)] = row.gates
    counted = all(row.segments for row in rows)
    stats = RolloutStats(passes=0, row_passes=torch.tensor([row.passes for row in rows]) if counted else None,
                         tokens=int(lengths.sum()))
    return RolloutBatch(
        prompts=[list(group.task.prompt_ids)], prompt_index=torch.zeros(len(rows), dtype=torch.long),
        prompt_lengths=torch.full((len(rows),), len(group.task.prompt_ids), dtype=torch.long),
        completion_ids=stack("completion_ids", pad_id), completion_lengths=lengths,
        completion_mask=torch.arange(width)[None, :] < lengths[:, None], exit_steps=stack("exit_steps", 0),
        logprobs=stack("logprobs", 0.0), tempered_logprobs=stack("tempered_logprobs", 0.0), gate_probs=gates,
        finish_reasons=[row.finish or "length" for row in rows], schedule=Schedule(kind, [], replayable=False),
        params=replace(params, prompt_seeds=[group.seed], n=len(rows)), stats=stats, num_loops=num_loops,
        dtype=dtype, pad_id=pad_id, kept_floor=stack("kept_floor", -1), exit_logprobs=stack("exit_logprobs", 0.0),
        versions=stack("versions", -1), forced_mask=stack("forced_mask", False))
