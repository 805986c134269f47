"""rltt: reinforcement-learning post-training for looped language models."""

__version__ = "0.1.0"
