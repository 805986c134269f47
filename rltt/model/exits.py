"""Exit gate arithmetic and exit policies (docs/design.md §1, §1.8).

Steps are 1-based throughout rltt: t* ∈ {1, …, T}.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rltt.errors import ConfigError
from rltt.objectives.lm import exit_distribution  # noqa: F401  (re-exported: the survival formula)

POLICY_KINDS = ("final", "fixed", "threshold", "sample")


@dataclass(frozen=True)
class ExitPolicy:
    """Which step's distribution a token is sampled from.

    ``final`` (t* = T), ``fixed:k`` (t* = k), ``threshold:q`` (first t with CDF_t ≥ q, else T),
    ``sample`` (t* ~ p).
    """

    kind: str = "final"
    value: float | int | None = None
    text: str | None = field(default=None, compare=False, repr=False)  # the spec it was parsed from

    @classmethod
    def parse(cls, spec: "str | ExitPolicy", num_loops: int | None, field: str = "exit_policy") -> "ExitPolicy":
        """Parse ``final | fixed:k | threshold:q | sample``; ``num_loops`` None: T not known yet.

        A policy is parsed once, where its text enters rltt (a recipe when it loads, a CLI flag,
        `SamplingParams` when built, a model's config once per value); what runs per call holds
        the parsed policy and only checks it against the model's T (`check`)."""
        if isinstance(spec, ExitPolicy):
            return spec.check(num_loops, field)
        text = str(spec).strip()
        kind, _, arg = text.partition(":")
        if kind not in POLICY_KINDS:
            raise ConfigError(f"{field}: unknown exit policy {text!r}; use final | fixed:k | threshold:q | sample")
        if kind in ("final", "sample"):
            if arg:
                raise ConfigError(f"{field}: exit policy {kind!r} takes no argument, got {text!r}")
            return cls(kind, None, str(spec)).check(num_loops, field)
        try:
            value = int(arg) if kind == "fixed" else float(arg)
        except ValueError:
            raise ConfigError(f"{field}: exit policy {text!r} needs a number after ':'") from None
        return cls(kind, value, str(spec)).check(num_loops, field)

    def check(self, num_loops: int | None, field: str = "exit_policy") -> "ExitPolicy":
        """``self`` when its step k / threshold q is in range for T = ``num_loops`` (None: T not
        known yet), else a one-line `ConfigError` naming ``field``."""
        if self.kind == "fixed" and not 1 <= int(self.value) <= (num_loops or int(self.value)):
            raise ConfigError(f"{field}: fixed:{self.value} is out of range 1..{num_loops or 'T'}")
        if self.kind == "threshold" and not 0.0 < float(self.value) <= 1.0:
            raise ConfigError(f"{field}: threshold:{self.value} must be in (0, 1]")
        return self

    def __str__(self) -> str:
        """The spec as written where it was parsed (a recipe's, a flag's), else ``kind[:value]``."""
        if self.text is not None:
            return self.text
        return self.kind if self.value is None else f"{self.kind}:{self.value}"

    def choose(self, exit_probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Exit step t* (1-based, int64) for every position of ``exit_probs`` (T, ...)."""
        num_loops = exit_probs.shape[0]
        shape = exit_probs.shape[1:]
        device = exit_probs.device
        if self.kind == "final":
            return torch.full(shape, num_loops, dtype=torch.long, device=device)
        if self.kind == "fixed":
            return torch.full(shape, int(self.value), dtype=torch.long, device=device)
        if self.kind == "threshold":
            cdf = torch.cumsum(exit_probs.float(), dim=0)
            reached = cdf >= float(self.value)
            reached[-1] = True  # else T
            return reached.float().argmax(dim=0) + 1
        # sample: t* ~ Categorical(p)
        flat = exit_probs.float().reshape(num_loops, -1).transpose(0, 1).clamp_min(0)
        steps = torch.multinomial(flat, 1, generator=generator).squeeze(-1) + 1
        return steps.reshape(shape)


def gate_lambda(mean_exit: float, num_loops: int) -> float:
    """The constant gate λ whose survival exit distribution has mean exit step ``mean_exit``:
    Σ_{t<T} (1 − λ)^t = mean_exit, by bisection (a gate bias of logit(λ) gives it)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        lam = (lo + hi) / 2
        mean = sum((1 - lam) ** t for t in range(num_loops))
        lo, hi = (lam, hi) if mean > mean_exit else (lo, lam)
    return (lo + hi) / 2


def exit_logprob(gate_probs: torch.Tensor, exit_steps: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``log p_{t*}`` of each token: the log-probability of its recorded exit step under the survival
    exit distribution of its state's gates (``exit_distribution``), in fp32.

    ``gate_probs`` (T, ...) λ_t, NaN where a step was never computed (the deferred schedule computes
    λ_1..λ_{t*}, all ``p_{t*}`` needs); ``exit_steps`` (...) 1-based t*. Where ``mask`` is false (or
    t* is 0: padding, forced tokens) the result is 0. The learner computes the same function of its
    own gates, so at the rollout weights the two differ only by the gates' rounding."""
    num_loops = gate_probs.shape[0]
    p = exit_distribution(gate_probs.float())
    steps = exit_steps.long()
    valid = (steps >= 1) & (steps <= num_loops)
    if mask is not None:
        valid &= mask.bool()
    index = torch.where(valid, steps - 1, torch.zeros_like(steps)).to(p.device)
    chosen = p.gather(0, index.unsqueeze(0)).squeeze(0)
    out = torch.log(chosen.clamp_min(torch.finfo(torch.float32).tiny))
    return torch.where(valid.to(p.device), out, torch.zeros_like(out))
