"""The RL learner (`Learner`: update, rollout weights, save/load): per-loop scoring, losses, backends."""

from rltt.learner.backends import DeepSpeedBackend, TorchBackend, make_backend
from rltt.learner.batch import LearnerBatch
from rltt.learner.config import AlgorithmConfig, LearnerConfig
from rltt.learner.learner import LEARNER_STATE, Learner, PolicyModule, frozen_copy
from rltt.learner.scoring import LoopScores, score_tokens, unwrap

__all__ = ["LEARNER_STATE", "AlgorithmConfig", "DeepSpeedBackend", "Learner", "LearnerBatch", "LearnerConfig",
           "LoopScores", "PolicyModule", "TorchBackend", "frozen_copy", "make_backend", "score_tokens", "unwrap"]
