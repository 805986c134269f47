"""The `Learner` interface (update / version / rollout_state_dict / save / load / sequence_kl)
over rltt's learner, and the builder that makes one inside a learner actor.

A learner's checkpoint directory holds what resuming it needs: the model weights (full tensors,
gathered under ZeRO-3; safetensors beside the model config, so the directory is also a model
directory), the optimizer/DeepSpeed state and ``learner.json`` (its version).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rltt.learner import LearnerBatch

VERSION_FILE = "learner.json"


class LearnerAdapter:
    """rltt's `rltt.learner.Learner` (``train_step`` / ``state_dict_for_rollout`` / its backend's
    ``save`` / ``load``) behind the `Learner` interface; ``rank`` / ``world`` of its process group."""

    def __init__(self, learner, rank: int = 0, world: int = 1, zero3: bool = False):
        self.inner, self.rank, self.world, self.zero3 = learner, rank, world, zero3
        self.version = 0

    def update(self, batch: LearnerBatch) -> dict[str, float]:
        metrics = self.inner.train_step(batch)
        self.version += 1
        return metrics

    def sequence_kl(self, batch: LearnerBatch) -> torch.Tensor:
        return self.inner.sequence_kl(batch).cpu()

    def rollout_state_dict(self) -> tuple[int, dict[str, torch.Tensor]]:
        tensors = self.inner.state_dict_for_rollout()  # a collective under ZeRO-3
        return self.version, {k: v.detach().contiguous() for k, v in tensors.items()}

    def _model(self):
        from rltt.learner import unwrap

        return unwrap(self.inner.model)

    def save(self, directory: Path) -> None:
        """Collective with several ranks: each writes its optimizer shard; rank 0 the weights."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        weights = self.inner.state_dict_for_rollout() if self.zero3 else None
        if self.rank == 0:
            self._model().save_pretrained(directory, safe_serialization=True, state_dict=weights)
            (directory / VERSION_FILE).write_text(json.dumps({"version": self.version}))
        self.inner.backend.save(directory)

    def load(self, directory: Path) -> None:
        from safetensors.torch import load_file

        directory = Path(directory)
        if not self.zero3:  # ZeRO-3's partitioned parameters come back from its own checkpoint
            weights = {}
            for f in sorted(directory.glob("*.safetensors")):
                weights.update(load_file(str(f)))
            self._model().load_state_dict(weights, strict=False)
        self.inner.backend.load(directory)
        record = directory / VERSION_FILE
        if record.exists():
            self.version = int(json.loads(record.read_text())["version"])
        else:  # a local run's checkpoint: one version per RL step
            self.version = self.inner.backend.updates // self.inner.algo.ppo_epochs


@dataclass
class LearnerFromDir:
    """Builds the learner a recipe describes on a checkpoint directory, as `LocalTrainer` does
    (same seed, same reference copy, same per-rank batch size), in the calling process."""

    recipe: object  # TrainRecipe
    model_path: str

    def __call__(self, rank: int = 0, world: int = 1) -> LearnerAdapter:
        from rltt.learner import Learner, frozen_copy
        from rltt.orchestration.policy import load_policy

        r = self.recipe
        torch.manual_seed(r.seed)
        model, _ = load_policy(Path(self.model_path), r.model.dtype, r.model.device, r.model.convert)
        reference = frozen_copy(model) if (r.algorithm.kl_coef > 0 or r.algorithm.track_kl) else None
        learner = Learner(model, r.learner, r.algorithm, batch_size=r.batch_size // world,
                          max_len=r.rollout.max_new_tokens, ref_model=reference)
        zero3 = r.learner.backend == "deepspeed" and r.learner.zero_stage == 3
        return LearnerAdapter(learner, rank, world, zero3)


def engine_dtype(recipe) -> str:
    """The dtype rollout engines run in: the learner's parameters' (what a local run samples with)."""
    return "bf16" if "bf16" in (recipe.learner.dtype, recipe.model.dtype) else "fp32"
