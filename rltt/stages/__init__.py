"""LM training stages: from-scratch LoopLM pretraining, dense-to-loop conversion, quickstart model.

- :mod:`rltt.stages.recipe` — typed recipe schemas (`PretrainRecipe`, `ConvertRecipe`) loaded
  with :mod:`rltt.config` (YAML + ``key=value`` overrides, one-line errors).
- :mod:`rltt.stages.pretrain` / :mod:`rltt.stages.convert` — ``pretrain(recipe)`` and
  ``convert(recipe)`` (the ``rltt pretrain`` / ``rltt convert`` commands).
- :mod:`rltt.stages.trainer` — the shared loop (AdamW, warmup + cosine, clipping, bf16/fp32,
  telemetry, collapse alarm, evaluation, atomic checkpoints, exact ``--resume``).
- :mod:`rltt.stages.quickstart` — ``ensure_quickstart_model()``: the tiny CPU LoopLM that
  the RL quickstart starts from, built on first use and cached.

Submodules are imported on use so that ``import rltt.stages`` stays light.
"""
