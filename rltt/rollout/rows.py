"""The per-token row record every rollout path shares, and the one function that pads rows into a
`RolloutBatch`.

A `Row` is one completion as it grows: for every per-token field of `TOKEN_FIELDS` (token id, exit
step, raw / tempered / exit log-probs, kept-set floor, gates, forced and environment marks,
weights version) one compact host array (int64 / fp32 / bool, the batch's own bytes per token),
and the per-row facts every path has — its finish reason and, where counted, the serial passes it
took part in. Every producer writes the same record:

- the native engine and the vLLM engine while decoding (`add` per sampled token, `force` for a
  thinking budget's interruption, gates as the engine reads them);
- multi-turn episodes (`rltt.orchestration.episodes`), which `take` each model turn from its
  engine call's batch and `add_env` the environment's answers;
- partial rollouts (`rltt.orchestration.ray.partial_rows`), which `take` each segment from its
  call's batch at the version that sampled it.

`rows_batch` pads any rows into a `RolloutBatch`; `rltt.rollout.rollout_batch.join_batches` lays
batches sampled apart side by side. Neither names a field: both follow the table, so a per-token
field added to `TOKEN_FIELDS` reaches every path.

Values are exact: an fp32 log-prob read as a Python float and stored back in an fp32 array keeps
its bits, and a batch's tensors are copied out of the arrays without arithmetic.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Sequence

import torch

from rltt.rollout.params import SamplingParams
from rltt.rollout.rollout_batch import TOKEN_FIELDS, RolloutBatch, RolloutStats, Schedule, TokenField

__all__ = ["Row", "rows_batch", "token_bytes"]

_NAN = float("nan")


def _arrays() -> dict[str, array]:
    return {f.name: array(f.code) for f in TOKEN_FIELDS}


def _sampled_default(f: TokenField):
    """A field's value on a sampled token its producer does not give: unknown (NaN) for a derived
    field, else its padding value (not forced, not the environment's, no version recorded)."""
    return _NAN if f.derived else f.pad


_REST: list = [None, []]  # the table it was made from, and `_sampled_rest`'s answer for it


def _sampled_rest() -> list[tuple[str, object]]:
    """(name, value) of the fields `Row.add` does not take, with their `_sampled_default` (made once
    per table: `add` runs for every sampled token)."""
    if _REST[0] is not TOKEN_FIELDS:
        taken = ("completion_ids", "exit_steps", "logprobs", "tempered_logprobs", "kept_floor")
        _REST[:] = [TOKEN_FIELDS, [(f.name, _sampled_default(f)) for f in TOKEN_FIELDS
                                   if not f.loops and f.name not in taken]]
    return _REST[1]


def token_bytes(loops: int) -> int:
    """Host bytes a row holds per completion token with ``loops`` loop steps: every field's item
    size, the gates' ``loops`` times (the memory plan counts a partial rollout's buffer with it)."""
    return sum(array(f.code).itemsize * (loops if f.loops else 1) for f in TOKEN_FIELDS)


@dataclass
class Row:
    """One completion row: ``values[name]`` the flat array of field ``name`` (`TOKEN_FIELDS`; the
    gates token-major, ``loops`` values per token), ``finish`` ``"stop"`` / ``"length"`` (None while
    it runs; a batch reads None as ``"length"``), ``passes`` the serial passes it took part in where
    its producer counts them per row (None: the engine's `RolloutStats` counts them).

    Gates arrive apart from tokens (an engine reads them once a chunk ends): a row whose gates
    array is empty has none (NaN in the batch); otherwise it holds ``loops`` per token."""

    values: dict[str, array] = field(default_factory=_arrays)
    finish: str | None = None
    passes: float | None = None

    # -- reading -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.values["completion_ids"])

    @property
    def ids(self) -> list[int]:
        return self.values["completion_ids"].tolist()

    def column(self, name: str) -> list:
        """Field ``name`` per token, as Python values."""
        return self.values[name].tolist()

    def tensor(self, name: str) -> torch.Tensor:
        """Field ``name`` as a tensor of its dtype (a copy; (n, T) for the gates)."""
        f = next(f for f in TOKEN_FIELDS if f.name == name)
        values = self.values[name]
        if not len(values):
            t = torch.zeros(0, dtype=f.dtype)
        else:
            t = torch.frombuffer(values, dtype=f.dtype).clone()
        return t.view(len(self), -1) if f.loops else t

    def nbytes(self) -> int:
        """Bytes of the row's per-token data (`token_bytes` per token once its gates are in)."""
        return sum(len(v) * v.itemsize for v in self.values.values())

    # -- writing -------------------------------------------------------------------------------
    def add(self, token: int, exit_step: int, raw: float, tempered: float, floor: int = -1) -> None:
        """Append one sampled token; every other field is its padding value (a derived one unknown:
        the exit log-prob comes from the gates)."""
        v = self.values
        v["completion_ids"].append(token)
        v["exit_steps"].append(exit_step)
        v["logprobs"].append(raw)
        v["tempered_logprobs"].append(tempered)
        v["kept_floor"].append(floor)
        for name, value in _sampled_rest():
            v[name].append(value)

    def extend(self, tokens: Sequence[int], exits: Sequence[int], raw: Sequence[float],
               tempered: Sequence[float], floors: Sequence[int] | None = None) -> None:
        """Append sampled tokens (one entry per token in each list; ``floors`` None: nothing truncated)."""
        k = len(tokens)
        self._append({"completion_ids": tokens, "exit_steps": exits, "logprobs": raw, "tempered_logprobs": tempered,
                      "kept_floor": [-1] * k if floors is None else floors}, k, sampled=True)

    def force(self, tokens: Sequence[int], loops: int | None = None, **values) -> None:
        """Append forced (not sampled) tokens: no exit step, no log-probs (``values``: fields set
        otherwise, e.g. ``versions``). ``loops``: also append their gates as NaN — a producer that
        computes none for them (the native engine reads a forced token's gates with the others')."""
        self._unsampled(tokens, "forced_mask", values, loops)

    def add_env(self, tokens: Sequence[int], loops: int) -> None:
        """Append the environment's tokens (with NaN gates: the model computed no exit for them)."""
        self._unsampled(tokens, "env_mask", {}, loops)

    def add_gates(self, gates: torch.Tensor | Sequence[Sequence[float]]) -> None:
        """Append the gates of the next tokens: a (T, k) tensor, or k per-token lists of T values."""
        if isinstance(gates, torch.Tensor):
            gates = gates.detach().float().cpu().T.contiguous().flatten().tolist()
        else:
            gates = [g for token in gates for g in token]
        self.values["gate_probs"].extend(gates)

    def take(self, batch: RolloutBatch, r: int, n: int, **values) -> None:
        """Append the first ``n`` tokens of row ``r`` of ``batch``, every field as the batch holds it
        (a field the batch did not record, its padding value); ``values``: fields set instead for
        all ``n`` (e.g. ``versions`` of a partial rollout's segment)."""
        for f in TOKEN_FIELDS:
            if f.loops:
                self.add_gates(getattr(batch, f.name)[:, r, :n])
            elif f.name in values:
                self.values[f.name].extend([values[f.name]] * n)
            else:
                src = getattr(batch, f.name)
                self.values[f.name].extend(src[r, :n].tolist() if src is not None else [f.pad] * n)

    def cut(self, n: int, loops: int) -> None:
        """Keep the first ``n`` tokens."""
        for f in TOKEN_FIELDS:
            del self.values[f.name][n * (loops if f.loops else 1):]

    def _append(self, given: dict[str, Sequence], k: int, sampled: bool) -> None:
        """Append ``k`` tokens: the ``given`` fields' values, every other field's default — for
        sampled tokens its padding value (unknown for a derived one), else its ``unsampled`` value."""
        for f in TOKEN_FIELDS:
            if f.loops:
                continue
            if f.name in given:
                self.values[f.name].extend(given[f.name])
            else:
                self.values[f.name].extend([_sampled_default(f) if sampled else f.unsampled] * k)

    def _unsampled(self, tokens: Sequence[int], mark: str, values: dict, loops: int | None) -> None:
        k = len(tokens)
        given = {"completion_ids": tokens, mark: [True] * k}
        for name, value in values.items():
            given[name] = [value] * k
        self._append(given, k, sampled=False)
        if loops is not None:
            self.add_gates(torch.full((loops, k), _NAN))

    # -- transport ----------------------------------------------------------------------------
    def plain(self) -> dict:
        """The row as tensors and Python values (a checkpoint's form): every field's tensor, the
        gates (T, n) — the batch's layout — and the per-row facts."""
        out = {f.name: self.tensor(f.name) for f in TOKEN_FIELDS}
        out["gate_probs"] = out["gate_probs"].T.contiguous()
        return {"tokens": out, "finish": self.finish, "passes": self.passes}

    def load(self, plain: dict) -> "Row":
        """Fill this (empty) row from `plain`'s form; a field the form lacks (a checkpoint written
        before the field existed) is its ``unsampled`` value per token."""
        tokens = plain["tokens"]
        n = int(tokens["completion_ids"].shape[0])
        for f in TOKEN_FIELDS:
            t = tokens.get(f.name)
            if t is None and f.loops:
                t = plain.get("gates")  # the name earlier checkpoints used
            if f.loops:
                if t is not None:
                    self.add_gates(t)
            elif t is None:
                self.values[f.name].extend([f.unsampled] * n)
            else:
                self.values[f.name].extend(t.to(f.dtype).tolist())
        self.finish, self.passes = plain.get("finish"), plain.get("passes")
        return self


def _stack(rows: Sequence[Row], f: TokenField, width: int, loops: int, pad_id: int) -> torch.Tensor:
    """Field ``f`` of ``rows`` right-padded to ``width``: (R, width), or (T, R, width) for the gates."""
    pad = pad_id if f.pad is None else f.pad
    if f.loops:
        out = torch.full((len(rows), width, loops), pad, dtype=f.dtype)
    else:
        out = torch.full((len(rows), width), pad, dtype=f.dtype)
    for i, row in enumerate(rows):
        n = len(row)
        values = row.values[f.name]
        if not n or not len(values):
            continue
        if f.loops and len(values) != n * loops:
            raise ValueError(f"Row: {len(values)} gate values for {n} tokens and {loops} loops")
        t = torch.frombuffer(values, dtype=f.dtype)
        out[i, :n] = t.view(n, loops) if f.loops else t
    return out.permute(2, 0, 1).contiguous() if f.loops else out


def rows_batch(prompts: list[list[int]], prompt_index: Sequence[int], rows: Sequence[Row], *, schedule: Schedule,
               params: SamplingParams, stats: RolloutStats, num_loops: int, dtype: torch.dtype,
               pad_id: int) -> RolloutBatch:
    """The `RolloutBatch` of ``rows`` (row r completes ``prompts[prompt_index[r]]``).

    Every per-token field is right-padded to the longest completion (at least one column) with its
    padding value (`TOKEN_FIELDS`); a row without gates has NaN gates; an exit log-prob a row left
    unknown (NaN: an engine's sampled token) is the one its gates give (`rltt.model.exits.exit_logprob`);
    ``versions`` is None when no row recorded one. ``schedule``, ``params`` (seed filled in),
    ``stats`` and ``dtype`` are the caller's."""
    width = max(1, max((len(row) for row in rows), default=0))
    columns = {f.name: _stack(rows, f, width, num_loops, pad_id) for f in TOKEN_FIELDS}
    for f in TOKEN_FIELDS:  # read from the arrays: a tensor's ``any()`` would be a host read per call
        if f.optional and not any(len(v) and (min(v) != f.pad or max(v) != f.pad)
                                  for v in (row.values[f.name] for row in rows)):
            columns[f.name] = None
    derived = {f.name: columns[f.name] for f in TOKEN_FIELDS if f.derived}
    for name in derived:
        columns[name] = None  # RolloutBatch computes it; recorded values are put back below
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    batch = RolloutBatch(
        prompts=prompts, prompt_index=torch.tensor(list(prompt_index), dtype=torch.long),
        prompt_lengths=torch.tensor([len(prompts[i]) for i in prompt_index], dtype=torch.long),
        completion_lengths=lengths, completion_mask=torch.arange(width)[None, :] < lengths[:, None],
        finish_reasons=[row.finish or "length" for row in rows], schedule=schedule, params=params, stats=stats,
        num_loops=num_loops, dtype=dtype, pad_id=pad_id, **columns)
    for name, recorded in derived.items():
        setattr(batch, name, torch.where(recorded.isnan(), getattr(batch, name), recorded))
    return batch
