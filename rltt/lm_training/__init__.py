"""LM training stages: from-scratch LoopLM pretraining, dense-to-loop conversion, quickstart model.

- :mod:`rltt.lm_training.stage_recipe` — typed recipe schemas (`PretrainRecipe`, `ConvertRecipe`) loaded
  with :mod:`rltt.config` (YAML + ``key=value`` overrides, one-line errors).
- :mod:`rltt.lm_training.pretraining` / :mod:`rltt.lm_training.conversion` — ``pretrain(recipe)`` and
  ``convert(recipe)`` (the ``rltt pretrain`` / ``rltt convert`` commands).
- :mod:`rltt.lm_training.stage_loop` — the shared loop (AdamW, warmup + cosine, clipping, bf16/fp32,
  telemetry, collapse alarm, evaluation, atomic checkpoints, exact ``--resume``).
- :mod:`rltt.lm_training.quickstart_model` — ``ensure_quickstart_model()``: the tiny CPU LoopLM that
  the RL quickstart starts from, built on first use and cached.

Submodules are imported on use so that ``import rltt.lm_training`` stays light.
"""
