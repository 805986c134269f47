"""Worker for the DeepSpeed tests: run under torchrun (2 ranks) or directly (1 rank).

Each rank trains on its shard of the same global batch with the DeepSpeed backend; rank 0
also trains a torch-backend copy on the whole batch in-process, then compares losses and
parameters and writes the verdict to the file named by argv[2].
"""

import json
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rltt.learner import AlgorithmConfig, Learner, LearnerConfig  # noqa: E402
from tests.learner.helpers import synthetic_batch, tiny_policy  # noqa: E402


def run(stage: int, out: str) -> None:
    algo = AlgorithmConfig(aggregation="token_mean", loss="ppo_clip")
    batches = [synthetic_batch(B=4, seed=s) for s in range(3)]
    ds_model = tiny_policy(seed=0)
    cfg = dict(lr=1e-2, micro_batch_size=1, grad_clip=0.5, warmup_steps=2)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    learner = Learner(ds_model, LearnerConfig(backend="deepspeed", zero_stage=stage, **cfg), algo,
                      batch_size=4 // world, max_len=8)
    ds_metrics = [learner.update(b.select(slice(rank * 4 // world, (rank + 1) * 4 // world))) for b in batches]
    ds_state = {k: v.float() for k, v in learner.rollout_state_dict()[1].items()}
    if rank == 0:
        compare(ds_metrics, ds_state, algo, cfg, batches, world, out)
    import torch.distributed as dist

    if dist.is_initialized():  # no rank exits while the gloo group is alive (that aborted rank 1 at times)
        dist.barrier()
        dist.destroy_process_group()


#: batch-level metrics every rank must report for the global batch, not its own shard
GLOBAL_KEYS = ("policy/clip_frac", "policy/ratio_mean", "policy/ratio_max", "policy/ratio_min", "entropy/loop_1",
               "entropy/loop_3", "exit/p_1", "exit/mean_step")


def compare(ds_metrics, ds_state, algo, cfg, batches, world: int, out: str) -> None:
    torch_model = tiny_policy(seed=0)
    ref = Learner(torch_model, LearnerConfig(backend="torch", **cfg), algo, batch_size=4, max_len=8)
    torch_metrics = [ref.update(b) for b in batches]
    diff = max((ds_state[k] - v.float()).abs().max().item() for k, v in torch_model.state_dict().items())
    with open(out, "w") as f:
        json.dump({"ds_losses": [m["loss/total"] for m in ds_metrics],
                   "torch_losses": [m["loss/total"] for m in torch_metrics], "max_param_diff": diff, "world": world,
                   "ds_changed": [m["sync/changed_frac"] for m in ds_metrics],
                   "torch_changed": [m["sync/changed_frac"] for m in torch_metrics],
                   "ds_global": [{k: m[k] for k in GLOBAL_KEYS} for m in ds_metrics],
                   "torch_global": [{k: m[k] for k in GLOBAL_KEYS} for m in torch_metrics]}, f)


if __name__ == "__main__":
    run(int(sys.argv[1]), sys.argv[2])
