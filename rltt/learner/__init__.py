"""The RL learner: per-loop scoring, schedule replay and hybrid log-probs, losses, backends."""

from rltt.learner.backends import DeepSpeedBackend, TorchBackend, make_backend
from rltt.learner.batch import LearnerBatch
from rltt.learner.config import AlgorithmConfig, LearnerConfig
from rltt.learner.learner import Learner, frozen_copy
from rltt.learner.scoring import LoopScores, score_tokens, unwrap

__all__ = ["AlgorithmConfig", "DeepSpeedBackend", "Learner", "LearnerBatch", "LearnerConfig", "LoopScores",
           "TorchBackend", "frozen_copy", "make_backend", "score_tokens", "unwrap"]
