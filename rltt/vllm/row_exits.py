"""Per-row exit decisions of a vLLM batch (no vllm import: unit-testable anywhere).

vLLM hands ``compute_logits`` the states of the positions it samples from, one row per
request, in the order of its input batch. `RowExits` says, for each row, which exit policy
applies and — for ``sample`` — which uniform draw decides it. The draw is the one the native
engine makes (`rltt.rollout.sampler.RowRandom`): a counter-based hash of the row's key (from
(seed, row) or (prompt seed, sample index)) and the index of the token being sampled, so a
row's exits depend only on its own key, never on its batch-mates or on vLLM's scheduling.

`choose_exits` applies the policies to the gate values λ (T, n) with the arithmetic of the
native engine's `ExitDecider` (survival distribution, CDF, first step reaching the threshold
or exceeding the draw, else T), so equal gates give equal exits.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from rltt.model.exits import ExitPolicy, exit_distribution
from rltt.rollout import seeds

KIND_CODES = {"final": 0, "fixed": 1, "threshold": 2, "sample": 3}


def uniforms_from_keys(keys: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """`RowRandom.uniform` given the row keys themselves (float64 in [0, 1))."""
    return seeds.uniforms(keys, counters, stream)


def row_keys(seed: int, num_rows: int, prompt_seeds: list[int] | None = None, n: int = 1) -> list[int]:
    """The native engine's per-row keys (int64 values) for a call with these seeds."""
    return seeds.row_keys(seed, num_rows, prompt_seeds, n).tolist()


@lru_cache(maxsize=64)
def parse_policy(spec: str, num_loops: int) -> ExitPolicy:
    """A policy's text parsed once per ``(spec, T)``: the config's default, and what a request's
    ``extra_args`` carry across vLLM's process boundary (text, not the `ExitPolicy`)."""
    return ExitPolicy.parse(spec, num_loops, field="SamplingParams.exit_policy")


@dataclass
class RowExits:
    """Exit settings of the n rows of one ``compute_logits`` call.

    ``kinds`` (n,) int64 (`KIND_CODES`); ``values`` (n,) float64 (k of ``fixed:k``, q of
    ``threshold:q``); ``uniforms`` (n,) float64, the exit draw of ``sample`` rows (else unused)."""

    kinds: torch.Tensor
    values: torch.Tensor
    uniforms: torch.Tensor

    @classmethod
    def uniform_policy(cls, policy: ExitPolicy, n: int, uniforms: torch.Tensor | None = None) -> "RowExits":
        value = 0.0 if policy.value is None else float(policy.value)
        return cls(torch.full((n,), KIND_CODES[policy.kind], dtype=torch.long),
                   torch.full((n,), value, dtype=torch.float64),
                   uniforms if uniforms is not None else torch.zeros(n, dtype=torch.float64))

    @classmethod
    def build(cls, policies: list[ExitPolicy], keys: list[int], counters: list[int]) -> "RowExits":
        """From each row's policy, key and token index."""
        kinds = torch.tensor([KIND_CODES[p.kind] for p in policies], dtype=torch.long)
        values = torch.tensor([0.0 if p.value is None else float(p.value) for p in policies], dtype=torch.float64)
        uniforms = uniforms_from_keys(torch.tensor(keys, dtype=torch.long), torch.tensor(counters, dtype=torch.long),
                                      seeds.EXIT)
        return cls(kinds, values, uniforms)


def choose_exits(gates: torch.Tensor, rows: RowExits) -> torch.Tensor:
    """Exit step t* (1-based, int64, (n,)) of each row from its gate values ``gates`` (T, n) fp32."""
    num_loops, n = gates.shape
    device = gates.device
    kinds = rows.kinds.to(device)
    cdf = torch.cumsum(exit_distribution(gates.float()), dim=0)  # (T, n)
    reached = torch.zeros_like(cdf, dtype=torch.bool)
    threshold = kinds == KIND_CODES["threshold"]
    if bool(threshold.any()):
        reached |= threshold[None] & (cdf >= rows.values.to(device)[None].float())
    sample = kinds == KIND_CODES["sample"]
    if bool(sample.any()):
        reached |= sample[None] & (cdf > rows.uniforms.to(device)[None])
    reached[-1] = True  # else T
    steps = reached.float().argmax(dim=0) + 1
    steps = torch.where(kinds == KIND_CODES["final"], torch.full_like(steps, num_loops), steps)
    return torch.where(kinds == KIND_CODES["fixed"], rows.values.to(device).long(), steps)
