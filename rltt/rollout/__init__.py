"""Rollout engines behind one interface (SPEC §2, §7).

- `RolloutEngine`: ``generate(prompts, SamplingParams) -> RolloutBatch``,
  ``load_weights(version, tensors)`` and ``weights_version``.
- `NativeEngine`: batched PyTorch generation with a per-(step, layer) KV cache, all exit
  policies, ``dense`` and ``deferred`` schedules and depth-mixed batching.
- `replay_logprobs`: bitwise re-execution of a rollout's recorded passes;
  `dense_logprobs` / `rollout_hybrid_logprob`: the learner side of SPEC §2.4.
"""

from rltt.rollout.batch import PassRecord, RolloutBatch, RolloutStats, Schedule
from rltt.rollout.engine import EXTRA_WEIGHTS, RolloutEngine
from rltt.rollout.native import NativeEngine
from rltt.rollout.params import SCHEDULES, SamplingParams
from rltt.rollout.replay import (DenseLogprobs, ReplayLogprobs, dense_logprobs, hybrid_logprob, replay_logprobs,
                                 rollout_hybrid_logprob)

__all__ = [
    "EXTRA_WEIGHTS",
    "SCHEDULES",
    "DenseLogprobs",
    "NativeEngine",
    "PassRecord",
    "ReplayLogprobs",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutStats",
    "SamplingParams",
    "Schedule",
    "dense_logprobs",
    "hybrid_logprob",
    "replay_logprobs",
    "rollout_hybrid_logprob",
]
