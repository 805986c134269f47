"""The rollout engine interface shared by the learner, curation and the vLLM worker."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

import torch

from rltt.rollout.batch import RolloutBatch
from rltt.rollout.params import SamplingParams


class RolloutEngine(ABC):
    """Generates completions with a looped model and takes weights from the learner."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` completions for each prompt (token ids); see `RolloutBatch`. An engine
        honours ``params.prompt_seeds`` (one seed per prompt) when given, else ``params.seed``."""

    @abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the engine's weights (names of `LoopedForCausalLM.state_dict()`)."""

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Take the weights of the learner's model (a `LoopedForCausalLM`)."""
        self.load_weights(model.state_dict())
