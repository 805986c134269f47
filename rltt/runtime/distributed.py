"""Data-parallel `rltt train`: this process's rank, its share of a step's prompts, and the one
cross-rank reduction every statistic goes through.

Under ``torchrun`` with ``learner.backend: deepspeed`` every rank draws the same global prompt
list (so the prompt stream, and with it ``--resume``, stays identical everywhere) and keeps
its contiguous share; DeepSpeed averages the gradients. The collectives go through the
process group DeepSpeed initialised (gloo on CPU, NCCL on GPU); with one process they are
identities, so a single-process run does exactly what it did before.

`combine` / `reduce_ranks` are the only way values are merged across ranks (rollout metrics,
evaluation sums, learner statistics): each key names its operation explicitly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from rltt.errors import ConfigError

#: the reductions `combine` and `reduce_ranks` know
REDUCE_OPS = ("sum", "mean", "max", "min", "concat")


def _concat(values: Sequence[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([torch.as_tensor(v) for v in values])
    if isinstance(first, Mapping):  # disjoint keys per rank (e.g. per-task rates): their union
        out: dict = {}
        for value in values:
            out.update(value)
        return out
    return [x for value in values for x in value]


def combine(parts: Sequence[Mapping[str, Any]], ops: str | Mapping[str, str]) -> dict[str, Any]:
    """Merge per-rank dicts (in rank order) key by key. ``ops``: one of `REDUCE_OPS` for every
    key, or a mapping key -> op naming every key. ``sum`` / ``max`` / ``min`` keep the values'
    type, ``mean`` is the sum over the number of parts, ``concat`` joins lists, tensors (dim 0)
    or dicts (union) in rank order."""
    if not parts:
        raise ValueError("combine: no parts")
    keys = list(parts[0])
    for part in parts[1:]:
        if list(part) != keys:
            raise ValueError(f"combine: the ranks' keys differ ({sorted(part)} vs {sorted(keys)})")
    out = {}
    for key in keys:
        op = ops if isinstance(ops, str) else ops.get(key)
        if op not in REDUCE_OPS:
            raise ValueError(f"combine: key {key!r} needs an op in {' | '.join(REDUCE_OPS)}, got {op!r}")
        values = [part[key] for part in parts]
        if op == "concat":
            out[key] = _concat(values)
        elif op == "max":
            out[key] = max(values)
        elif op == "min":
            out[key] = min(values)
        else:
            total = values[0]
            for value in values[1:]:
                total = total + value
            out[key] = total / len(values) if op == "mean" else total
    return out


def world_size() -> int:
    """Processes in the default group (1 without torch.distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def reduce_ranks(values: Mapping[str, Any], ops: str | Mapping[str, str], world: int | None = None) -> dict[str, Any]:
    """`combine` of every rank's ``values`` (a collective: every rank calls it with the same keys
    and ops, in the same order). ``world`` 1 (or one process) returns ``combine([values])``
    without communicating; ``None`` means the default process group's size."""
    world = world_size() if world is None else world
    if world == 1:
        return combine([values], ops)
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, dict(values))
    return combine(gathered, ops)


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

    def span(self, total: int) -> range:
        """The global indices of this rank's contiguous share of ``total`` items (divisible)."""
        per = total // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    def segment_span(self, counts: Sequence[int]) -> range:
        """This rank's global indices when rank i takes ``counts[i]`` items, in rank order."""
        start = sum(counts[:self.rank])
        return range(start, start + counts[self.rank])

    def reduce(self, values: Mapping[str, Any], ops: str | Mapping[str, str]) -> dict[str, Any]:
        """`reduce_ranks` over this run's ranks (a collective when world > 1)."""
        return reduce_ranks(values, ops, self.world)

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        """End of a data-parallel run: wait for every rank, then tear the process group down (a
        process that exits with it alive can abort in gloo's teardown)."""
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def ranks_from_env(backend: str, prompts_per_step: int, data_parallel: Sequence[str] = ("deepspeed",)) -> Ranks:
    """The launcher's RANK / WORLD_SIZE / LOCAL_RANK, checked against the recipe before any work;
    ``data_parallel``: the learner backends that train across ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    if backend not in data_parallel:
        raise ConfigError(f"learner.backend: {backend!r} trains in one process but {world} were launched "
                          f"(WORLD_SIZE={world}); use learner.backend={' | '.join(data_parallel)} for a "
                          f"data-parallel run")
    if prompts_per_step % world:
        raise ConfigError(f"rollout.prompts_per_step: {prompts_per_step} is not divisible by the world size "
                          f"{world} (each rank samples an equal share of the step's prompts)")
    ranks = Ranks(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
    if torch.cuda.is_available():  # "auto" / "cuda" then mean this rank's GPU
        torch.cuda.set_device(ranks.local_rank)
    return ranks
