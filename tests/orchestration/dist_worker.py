"""Worker for the data-parallel `rltt train` tests, run under torchrun:

    dist_worker.py RECIPE.yaml OUT_DIR [key=value ...]

Each rank runs the Trainer and writes OUT_DIR/rank<R>.json: the task ids and prompt
seeds of its groups, the rewards of its groups per step, its learner's batch size, whether it
owns a metrics logger, whether its parameters changed, a checksum of its final parameters, its
prompt stream's position and one `reduce_ranks` of known per-rank values.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from rltt.runtime.distributed import reduce_ranks  # noqa: E402
from rltt.orchestration.trainer import Trainer  # noqa: E402
from rltt.orchestration.train_recipe import load_train_recipe  # noqa: E402


def run(recipe: str, out_dir: str, overrides: list[str]) -> None:
    trainer = Trainer(load_train_recipe(recipe, overrides), recipe_root=Path(recipe).parent)
    rank = trainer.ranks.rank
    record = {"rank": rank, "world": torch.distributed.get_world_size(), "batch_size": trainer.learner.batch_size,
              "has_logger": trainer.logger is not None, "seeds": [], "task_ids": [], "rewards": []}
    before = {k: v.detach().clone() for k, v in trainer.learner_model().state_dict().items()}

    rollout = trainer.training.rollout

    def recording_rollout(step):
        groups, metrics = rollout(step)
        record["seeds"].append(list(groups.prompt_seeds))
        record["task_ids"].append(list(groups.task_ids))
        record["rewards"].append(groups.rewards.tolist())
        return groups, metrics

    trainer.training.rollout = recording_rollout
    trainer.run()
    values = {"n": rank + 1, "x": 0.5 * (rank + 1), "hi": rank, "lo": rank, "rows": [rank, rank],
              "t": torch.tensor([float(rank)]), "ids": {f"r{rank}": rank}}
    ops = {"n": "sum", "x": "mean", "hi": "max", "lo": "min", "rows": "concat", "t": "concat", "ids": "concat"}
    reduced = reduce_ranks(values, ops)
    record["reduced"] = {**reduced, "t": reduced["t"].tolist()}
    after = trainer.learner_model().state_dict()
    record["changed"] = any(not torch.equal(before[k], after[k]) for k in before)
    record["checksum"] = sum(float(v.double().sum()) for v in after.values())
    record["stream_position"] = trainer.prompts.position
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    trainer.ranks.close()


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3:])
