"""Running RL: the train recipe, prompt streams, scored groups, the one training step
(`step.TrainingStep`), the engine/learner factories (`components`), cross-rank reductions
(`distributed`) and the loop (`local.LocalTrainer`, single-process or torchrun data-parallel).
"""
