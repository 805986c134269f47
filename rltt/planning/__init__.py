"""Memory planning of a train recipe before anything loads (``rltt plan``).

- `shapes`: a config.json → the `LoopConfig` rltt would build, exact parameter count, KV bytes per token;
- `settings`: the recipe values memory depends on (`RunSettings`);
- `activations`, `rollout_memory`: the per-micro-batch and per-chunk formulas;
- `footprint`: per-device bytes of each part and the two phases' peaks;
- `held_rows`: host memory of the rows an asynchronous (Ray, K ≥ 1) run holds ahead;
- `chunking`: the rollout chunk (``rollout.chunk_rows: auto | N``);
- `plan`: `plan_run(recipe, model_config_dict, device_bytes, gpus)` → `MemoryPlan`;
- `advice`: the one-line verdict naming the recipe keys to change;
- `sources`, `report`: the config.json and device memory for the CLI, and the printed table.
"""

from rltt.planning.memory_plan import MemoryPlan, plan_run
from rltt.planning.shapes import ModelShape, model_shape

__all__ = ["MemoryPlan", "ModelShape", "model_shape", "plan_run"]
