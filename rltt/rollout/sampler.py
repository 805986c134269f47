"""Token sampling, sampling log-probs and online exit decisions.

Exit decisions are made step by step, from the gate probabilities computed so far, so a
token exits without computing deeper steps (SPEC §1.4):

- ``final`` / ``fixed:k``: t* = T / k, known upfront;
- ``threshold:q``: exit at the first t with CDF_t ≥ q (else T) — the CDF is computed with
  `rltt.model.exit_distribution` exactly as `ExitPolicy.choose` does, on the prefix of gates;
- ``sample``: draw u ~ U[0, 1) once per token and exit at the first t with CDF_t > u (else T):
  inverse-CDF sampling of t* ~ p.

Randomness is per row: row r draws its exit uniforms and its tokens from its own generator
(`row_generators`), in token order. So a row's random stream does not depend on the batch
or the schedule — `dense` and `deferred` with the same seed make the same draws.
"""

from __future__ import annotations

import torch

from rltt.model.exits import ExitPolicy, exit_distribution
from rltt.rollout.params import SamplingParams


def row_generators(seed: int, num_rows: int) -> list[torch.Generator]:
    """One CPU generator per row, seeded from (seed, row)."""
    mix = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct rows get well-separated seeds
    return [torch.Generator().manual_seed((seed * mix + row) % 2**63) for row in range(num_rows)]


class ExitDecider:
    """Decides, after a token's step t is computed, whether it exits there."""

    def __init__(self, policy: ExitPolicy, num_loops: int, generators: list[torch.Generator]):
        self.policy, self.num_loops, self.generators = policy, num_loops, generators
        self.uniform = torch.zeros(len(generators))  # u of each row's current token (sample policy)

    def start_tokens(self, rows: list[int]) -> None:
        """Rows beginning a new decode token: draw their u (sample policy only)."""
        if self.policy.kind == "sample":
            for r in rows:
                self.uniform[r] = torch.rand((), generator=self.generators[r])

    def exits(self, rows: list[int], step: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """Bool (n,): does the decode token of each row exit at ``step`` (n,)?

        ``gates`` (T, n) fp32 holds λ_1..λ_step of each token (later entries are ignored)."""
        kind = self.policy.kind
        if kind == "final":
            return step == self.num_loops
        if kind == "fixed":
            return step == int(self.policy.value)
        steps = torch.arange(1, self.num_loops + 1)[:, None]
        lam = torch.where(steps <= step[None], torch.nan_to_num(gates), torch.zeros_like(gates))
        cdf = torch.cumsum(exit_distribution(lam), dim=0).gather(0, (step - 1)[None])[0]
        if kind == "threshold":
            reached = cdf >= float(self.policy.value)
        else:
            reached = cdf > self.uniform[rows]
        return reached | (step == self.num_loops)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw, tempered) fp32 log-probs of ``tokens`` (k,) under fp32 ``logits`` (k, V).

    raw: ``log_softmax(logits)``; tempered: ``log_softmax(logits / temperature)`` (= raw when
    greedy). Top-k/top-p truncation is not applied (they are sampling heuristics)."""
    index = tokens[:, None]
    raw = torch.log_softmax(logits, dim=-1).gather(1, index)[:, 0]
    if temperature in (0, 1):
        return raw, raw.clone()
    tempered = torch.log_softmax(logits / temperature, dim=-1).gather(1, index)[:, 0]
    return raw, tempered


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """Next tokens (k,) from fp32 ``logits`` (k, V): argmax when greedy, else temperature, top-k,
    top-p, then a multinomial draw for row i from ``generators[i]``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_scores, dim=-1)) >= params.top_p  # mass before ≥ p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scores, dim=-1).cpu()  # the row generators are CPU generators
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)]).to(logits.device)
