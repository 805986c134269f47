"""The rollout engine interface shared by the training step, curation, evaluation and the vLLM worker."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator, Mapping

import torch

from rltt.rollout.rollout_batch import RolloutBatch
from rltt.rollout.params import SamplingParams
from rltt.rollout.turns import ResubmitTurns, TurnSession

#: trainable tensors a learner owns beside the model that it hands to the engines with the weights
#: (the learned loop weights of ω = ``learned``, shape (T,))
EXTRA_WEIGHTS = ("loop_weight_logits",)


class RolloutEngine(ABC):
    """Generates completions with a looped model and takes weights from the learner.

    ``weights_version``: the learner version of the weights it serves (0 = as constructed).
    ``replayable``: whether its batches carry a pass record `replay_logprobs` re-executes bitwise
    (``batch.schedule.replayable``). `close` releases what the engine holds (a process, files);
    it does nothing by default."""

    weights_version: int = 0
    replayable: bool = False

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` completions for each prompt (token ids); see `RolloutBatch`. An engine
        honours ``params.prompt_seeds`` (one seed per prompt) over ``params.seed``: a row's tokens
        depend only on (weights, prompt, its prompt seed, sample index), never on batch-mates."""

    @abstractmethod
    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Serve ``tensors`` from now on — names of `LoopedForCausalLM.state_dict()` plus any of
        `EXTRA_WEIGHTS` — and set ``weights_version = version``; drops any cached KV/prefix state."""

    def close(self) -> None:
        """Release what the engine holds (engines running a process override this); nothing by default."""

    def open_turns(self, prompts: list[list[int]], params: SamplingParams, max_tokens: int) -> Iterator[TurnSession]:
        """The turn sessions of a multi-turn episode call (`rltt.rollout.turns`): consecutive whole
        prompts, ``params.n`` rows each, whose episodes hold at most ``max_tokens`` completion tokens.
        The caller finishes (and closes) each session before asking for the next, so an engine may
        open them one at a time. By default one `ResubmitTurns` over every prompt: each later turn
        is a new ``generate`` call on the row's whole sequence."""
        yield ResubmitTurns(self, prompts, params)
