"""The RL learner (`Learner`: update, rollout weights, save/load): per-loop scoring, losses, backends."""

from rltt.learner.api import LearnerAPI
from rltt.learner.backends import DeepSpeedBackend, TorchBackend, make_backend
from rltt.learner.learner_batch import LearnerBatch
from rltt.learner.settings import AlgorithmConfig, LearnerConfig
from rltt.learner.learner import LEARNER_STATE, SKIP_REASON, Learner, PolicyModule
from rltt.learner.scoring import LoopScores, score_tokens, unwrap

__all__ = ["LEARNER_STATE", "AlgorithmConfig", "DeepSpeedBackend", "Learner", "LearnerAPI", "LearnerBatch",
           "LearnerConfig", "LoopScores", "PolicyModule", "SKIP_REASON", "TorchBackend", "make_backend", "score_tokens", "unwrap"]
