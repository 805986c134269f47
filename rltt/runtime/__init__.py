"""Run infrastructure shared by every command (RL training, pretraining, conversion, curation).

- :mod:`rltt.runtime.checkpoint` — atomic checkpoint directories, pruning, resume lookup, safe
  state files and RNG state.
- :mod:`rltt.runtime.guard` — the non-finite guard (skip a NaN/inf update, stop after K in a row).
- :mod:`rltt.runtime.paths` — output paths that never overwrite an input or another run.
- :mod:`rltt.runtime.device` — ``model.device`` (``auto``, ``cpu``, ``cuda:N``).
- :mod:`rltt.runtime.distributed` — data-parallel ranks and the one cross-rank reduction.
- :mod:`rltt.runtime.allocator` — ``PYTORCH_CUDA_ALLOC_CONF``: expandable segments unless the user chose.

Nothing here imports the model, the rollout engines, the learner or the loops built on them.
"""
