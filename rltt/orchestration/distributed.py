"""Data-parallel `rltt train`: this process's rank, its share of a step's prompts, and the few
collectives the loop needs.

Under ``torchrun`` with ``learner.backend: deepspeed`` every rank draws the same global prompt
list (so the prompt stream, and with it ``--resume``, stays identical everywhere) and keeps
its contiguous share; DeepSpeed averages the gradients. The collectives go through the
process group DeepSpeed initialised (gloo on CPU, NCCL on GPU); with one process they are
identities, so a single-process run does exactly what it did before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rltt.errors import ConfigError

#: rank r samples with seed ``step_seed + r * RANK_SEED_STRIDE`` (rank 0 keeps the step seed)
RANK_SEED_STRIDE = 1_000_000_000_039


@dataclass(frozen=True)
class Ranks:
    """This process's place in a data-parallel run (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the only rank that writes metrics, recipe.yaml and checkpoints."""
        return self.rank == 0

    def share(self, items: Sequence) -> list:
        """This rank's contiguous share of ``items`` (whose length the world size divides)."""
        per = len(items) // self.world
        return list(items[self.rank * per:(self.rank + 1) * per])

    def segment(self, items: Sequence, counts: Sequence[int]) -> list:
        """This rank's slice of ``items`` when rank i takes ``counts[i]`` of them, in rank order."""
        start = sum(counts[:self.rank])
        return list(items[start:start + counts[self.rank]])

    def seed(self, step_seed: int) -> int:
        return step_seed + self.rank * RANK_SEED_STRIDE

    def gather(self, value: Any) -> list:
        """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
        if self.world == 1:
            return [value]
        out: list = [None] * self.world
        torch.distributed.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        """End of a data-parallel run: wait for every rank, then tear the process group down (a
        process that exits with it alive can abort in gloo's teardown)."""
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def ranks_from_env(backend: str, prompts_per_step: int) -> Ranks:
    """The launcher's RANK / WORLD_SIZE / LOCAL_RANK, checked against the recipe before any work."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    if backend != "deepspeed":
        raise ConfigError(f"learner.backend: {backend!r} trains in one process but {world} were launched "
                          f"(WORLD_SIZE={world}); use learner.backend=deepspeed for a data-parallel run")
    if prompts_per_step % world:
        raise ConfigError(f"rollout.prompts_per_step: {prompts_per_step} is not divisible by the world size "
                          f"{world} (each rank samples an equal share of the step's prompts)")
    ranks = Ranks(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
    if torch.cuda.is_available():  # "auto" / "cuda" then mean this rank's GPU
        torch.cuda.set_device(ranks.local_rank)
    return ranks


@dataclass
class RolloutTally:
    """What the rollout metrics are computed from: one rank's groups, or all ranks' merged, so
    the logged numbers describe the whole step's batch."""

    group_size: int
    rewards: list[float]
    per_fn: dict[str, list[float]]
    lengths: list[int]
    truncated: int  # completions stopped by max_new_tokens
    exit_steps: int  # summed over completion tokens
    errors: int
    row_passes: float  # the engine's serial block passes, summed over rows
    tokens: int  # completion tokens the engine generated (0 when it reported no passes)

    @classmethod
    def of(cls, groups, stats) -> "RolloutTally":
        """From one rank's ``ScoredGroups`` and its engine's ``RolloutStats``."""
        counted = stats.row_passes is not None
        return cls(groups.group_size, list(groups.rewards), {k: list(v) for k, v in groups.per_fn.items()},
                   [len(c.completion_ids) for c in groups.completions],
                   sum(c.finish_reason == "length" for c in groups.completions),
                   sum(sum(c.exit_steps) for c in groups.completions), len(groups.errors),
                   float(stats.row_passes.sum()) if counted else 0.0, stats.tokens if counted else 0)

    @classmethod
    def merge(cls, tallies: Sequence["RolloutTally"]) -> "RolloutTally":
        """Rank-ordered tallies as one (each rank's rows are whole groups, so groups stay intact)."""
        if len(tallies) == 1:
            return tallies[0]
        first = tallies[0]
        return cls(first.group_size, [x for t in tallies for x in t.rewards],
                   {k: [x for t in tallies for x in t.per_fn[k]] for k in first.per_fn},
                   [x for t in tallies for x in t.lengths], sum(t.truncated for t in tallies),
                   sum(t.exit_steps for t in tallies), sum(t.errors for t in tallies),
                   sum(t.row_passes for t in tallies), sum(t.tokens for t in tallies))

    @property
    def passes_per_token(self) -> float:
        return self.row_passes / self.tokens if self.tokens else 0.0
