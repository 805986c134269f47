"""Every seed and random draw of a run, derived in one place.

Two hash families, each with one job:

- **SplitMix64's finaliser** — `mix64` on Python ints, `mix64_tensor` on int64 tensors (the same
  function: `tests/rollout/test_seeds.py` checks they agree). It keys a step's prompts
  (`rollout_seed`: recipe seed, step, attempt, global prompt index), a partial rollout's segments
  (`segment_seed`), the rows of an engine call (`row_keys`: (seed, row) or (prompt seed, sample
  index)) and the counter-based uniforms a row draws its tokens and exits from (`uniforms`: key,
  token counter, stream) — on the model's device, vectorised over a pass's rows, for the native
  engine and the vLLM worker alike, so a row's draws depend on its own key alone.
- **BLAKE2b** — `turn_seed`, the seed of a multi-turn episode's later turns. It predates the
  others' sharing of one home and stays as it is: a different hash would change every recorded
  multi-turn rollout.

Seeds are 63-bit non-negative ints (what `SamplingParams.seed` and ``prompt_seeds`` take); keys
and counters are int64 bit patterns (torch has no uint64 arithmetic; multiplications wrap modulo
2^64, shifts are made logical by `shr`).
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["TOKEN", "EXIT", "mix64", "mix64_tensor", "rollout_seed", "segment_seed", "turn_seed", "row_keys",
           "uniforms"]

_MASK = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_ROW, _COUNTER, _STREAM = 0xD6E8FEB86659FD93, 0xA0761D6478BD642F, 0xE7037ED1A0B428DB

TOKEN, EXIT = 0, 1  # the streams a row draws from: its tokens, its exits


def signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: int) -> int:
    """SplitMix64's finaliser of a 64-bit value (an unsigned Python int)."""
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK
    return x ^ (x >> 31)


def mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """`mix64` on int64 tensors (bit patterns)."""
    x = x + signed(_GOLDEN)
    x = (x ^ shr(x, 30)) * signed(_MIX1)
    x = (x ^ shr(x, 27)) * signed(_MIX2)
    return x ^ shr(x, 31)


def rollout_seed(seed: int, step: int, attempt: int, index: int) -> int:
    """The sampling seed of a step's ``index``-th prompt (global, over all ranks) in draw
    ``attempt`` (0, then dynamic-sampling refills): a 63-bit hash of the four. ``index`` -1 is the
    call's own seed; -2 keys a partial rollout's segments (`segment_seed`)."""
    h = 0
    for value in (seed, step, attempt, index):
        h = mix64(h ^ (value & _MASK))
    return h >> 1


def segment_seed(seed: int, sample: int, segment: int) -> int:
    """The prompt seed of segment ``segment`` (≥ 1) of sample ``sample`` of a group seeded ``seed``
    (a partial rollout's row continued as a one-row call)."""
    return rollout_seed(seed, sample, segment, -2)


def turn_seed(seed: int, sample: int, turn: int) -> int:
    """The sampling seed of turn ``turn`` (2, 3, ...) of sample ``sample`` of a prompt whose first
    turn drew from ``seed`` (or of row ``sample`` of a call seeded ``seed``): a 63-bit hash of the
    three."""
    digest = hashlib.blake2b(f"{seed}:{sample}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def row_keys(seed: int, num_rows: int | None = None, prompt_seeds: list[int] | None = None,
             n: int = 1) -> torch.Tensor:
    """The (R,) int64 keys of a call's rows, on the host: from (prompt seed, sample index) with
    per-prompt seeds — a prompt's rows do not depend on the other prompts of the call — else from
    (``seed``, row index)."""
    if prompt_seeds is not None:
        seeds = torch.tensor([s % (1 << 63) for s in prompt_seeds], dtype=torch.long).repeat_interleave(n)
        index = torch.arange(len(prompt_seeds) * n) % n
    else:
        rows = num_rows if num_rows is not None else 1
        seeds, index = torch.full((rows,), seed % (1 << 63), dtype=torch.long), torch.arange(rows)
    return mix64_tensor(mix64_tensor(seeds) ^ (index * signed(_ROW)))


def uniforms(keys: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """The uniform in [0, 1) (float64, 53 random bits) of each key at its counter in ``stream``."""
    x = mix64_tensor(keys ^ (counters * signed(_COUNTER)) ^ (stream * signed(_STREAM)))
    return shr(x, 11).double() * 2.0**-53
