"""`LearnerAPI`: what the training step needs of a learner — satisfied by `Learner` (one process
or a torchrun/DeepSpeed rank) and by any other implementation (a Ray learner group)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from rltt.learner.learner_batch import LearnerBatch


@runtime_checkable
class LearnerAPI(Protocol):
    version: int  # bumps by 1 on every update() that changed the weights

    def update(self, batch: LearnerBatch) -> dict[str, float]:
        """Optimise on ``batch``; the metrics of the global batch. An update the non-finite guard
        skipped (no weight change, ``version`` unchanged) names why under ``rltt.learner.SKIP_REASON``."""

    def sequence_kl(self, batch: LearnerBatch) -> torch.Tensor:
        """(B,) summed KL to the frozen reference, for ``algorithm.kl_in=reward``."""

    def rollout_state_dict(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, full tensors in the engines' dtype, learned extras included)."""

    def save(self, directory: Path) -> None:
        """Everything needed to resume the learner."""

    def load(self, directory: Path) -> None:
        """Resume from what `save` wrote."""

    def checkpointed(self, directory: Path) -> None:
        """The checkpoint ``directory`` (holding what `save` wrote) is complete: the one a
        learner that can be rebuilt names to resume from."""

    def close(self) -> None:
        """Release what the learner holds beyond this process's memory (actors, process groups)."""
