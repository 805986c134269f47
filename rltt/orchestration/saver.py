"""Checkpoints of an RL run: the one place they are written and found again.

A checkpoint ``RUN_DIR/checkpoints/step_N`` holds the learner's state (weights as a loadable
model directory, optimizer, version — written by the learner itself, on every rank or actor
that owns a part), the tokenizer, the recipe and the loop state (``rl_state.pt``: step, prompt
stream, RNG, guard, what the training step keeps). It is written into a staging directory and
moved into place atomically, so a kill at any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import yaml

from rltt.config import to_dict
from rltt.learner import LearnerAPI
from rltt.runtime.checkpoint import atomic_dir, checkpoint_dir, latest_checkpoint, load_state_file, prune_checkpoints
from rltt.runtime.distributed import Ranks

STATE_FILE = "rl_state.pt"


class CheckpointSaver:
    """Writes and finds the run's checkpoints. `save` is a collective under torchrun: every
    rank's learner writes its part into one staging directory, which rank 0 completes and moves
    into place."""

    def __init__(self, run_dir: Path, recipe, ranks: Ranks, tokenizer, learner: LearnerAPI):
        self.run_dir, self.recipe, self.ranks = run_dir, recipe, ranks
        self.tokenizer, self.learner = tokenizer, learner

    def save(self, step: int, state: dict) -> Path:
        """Checkpoint ``step`` with the loop ``state`` (tensors and plain data only)."""
        final = checkpoint_dir(self.run_dir, step)
        staged = final.parent / f".staged-{final.name}"
        if self.ranks.main:
            shutil.rmtree(staged, ignore_errors=True)  # left by a crash
        self.ranks.barrier()
        self.learner.save(staged)  # returns once every rank (or actor) has written

        def write(tmp: Path) -> None:
            os.replace(staged, tmp)
            self.tokenizer.save_pretrained(tmp)
            (tmp / "recipe.yaml").write_text(yaml.safe_dump(to_dict(self.recipe), sort_keys=False))
            torch.save(state, tmp / STATE_FILE)

        if self.ranks.main:
            atomic_dir(final, write)
            prune_checkpoints(self.run_dir, self.recipe.checkpoint.keep_last, self.recipe.checkpoint.keep_every,
                              STATE_FILE)
        self.ranks.barrier()  # the checkpoint is complete before any rank moves on
        self.learner.checkpointed(final)
        return final

    def latest(self) -> tuple[Path, dict] | None:
        """The newest complete checkpoint and its loop state, or None. The state file holds
        tensors and plain data only: reading it never runs code."""
        ckpt = latest_checkpoint(self.run_dir, STATE_FILE)
        if ckpt is None:
            return None
        return ckpt, load_state_file(ckpt / STATE_FILE)
