"""Rollout engines behind one interface (docs/design.md §2, §7).

- `RolloutEngine`: ``generate(prompts, SamplingParams) -> RolloutBatch``,
  ``load_weights(version, tensors)`` and ``weights_version``.
- `NativeEngine`: batched PyTorch generation with a per-(step, layer) KV cache, all exit
  policies, ``dense`` and ``deferred`` schedules and depth-mixed batching.
- `replay_logprobs`: bitwise re-execution of a rollout's recorded passes.
"""

from rltt.rollout.rollout_batch import PassRecord, RolloutBatch, RolloutStats, Schedule
from rltt.rollout.engine import EXTRA_WEIGHTS, RolloutEngine
from rltt.rollout.native import NativeEngine
from rltt.rollout.params import SCHEDULES, SamplingParams
from rltt.rollout.replay import ReplayLogprobs, replay_logprobs

__all__ = [
    "EXTRA_WEIGHTS",
    "SCHEDULES",
    "NativeEngine",
    "PassRecord",
    "ReplayLogprobs",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutStats",
    "SamplingParams",
    "Schedule",
    "replay_logprobs",
]
