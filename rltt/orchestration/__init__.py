"""Running RL: the train recipe, prompt streams, rollout→learner batches and the local loop.

The single-process loop (`LocalTrainer`) is the embedded default.
"""
