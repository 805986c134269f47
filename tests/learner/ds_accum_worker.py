"""Worker for the gradient-accumulation tests: run under torchrun (2 ranks) or directly (1 rank).

For each ZeRO stage in argv[1] (comma-separated) it runs, under `AccumulationProbe`:
- ``linear``: one update of rltt's DeepSpeed backend on a bf16 linear layer over 64 micro-batches
  whose gradients are all about the same positive size (a bf16 running sum of them drifts: each
  addition to a growing sum rounds away part of the addend); every rank runs the same
  micro-batches, so DeepSpeed's average over ranks is each rank's sum;
- ``learner``: one bf16 `Learner.update` of a tiny looped policy (16 micro-batches).

Rank 0 writes ``{stage: {"linear": check, "learner": check, "optimizer": class}}`` to argv[2].
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from rltt.learner import AlgorithmConfig, Learner, LearnerConfig  # noqa: E402
from rltt.learner.accumulation import AccumulationProbe  # noqa: E402
from rltt.learner.backends import DeepSpeedBackend  # noqa: E402
from tests.learner.helpers import synthetic_batch, tiny_policy  # noqa: E402

MICRO_STEPS = 64


def linear(stage: int) -> tuple[dict, str]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    inputs = [(1 + 0.1 * torch.rand(4, 16)).to(torch.bfloat16) for _ in range(MICRO_STEPS)]
    cfg = LearnerConfig(backend="deepspeed", zero_stage=stage, dtype="bf16", micro_batch_size=4, lr=1e-3)
    backend = DeepSpeedBackend(model, cfg, accumulation=MICRO_STEPS)
    with AccumulationProbe(backend) as probe:
        for x in inputs:
            backend.backward(backend.forward_model(x).float().sum())
        _, reason = backend.step([])
    assert reason is None, reason
    return probe.result.as_dict(), type(backend.engine.optimizer).__name__


def learner(stage: int, rank: int, world: int) -> dict:
    cfg = LearnerConfig(backend="deepspeed", zero_stage=stage, dtype="bf16", micro_batch_size=1, lr=1e-3)
    rows = 16
    learn = Learner(tiny_policy(seed=0), cfg, AlgorithmConfig(track_kl=False), batch_size=rows // world, max_len=8)
    batch = synthetic_batch(B=rows, seed=1).select(slice(rank * rows // world, (rank + 1) * rows // world))
    names = {name for name, _ in learn.policy.named_parameters()}  # trained: every parameter (tied ones once)
    before = {k: v.clone() for k, v in learn.rollout_state_dict()[1].items() if k in names}  # gathered (ZeRO-3)
    with AccumulationProbe(learn.backend) as probe:
        metrics = learn.update(batch)
    assert "skip_reason" not in metrics, metrics
    after = learn.rollout_state_dict()[1]
    changed = sum(int((after[k] != v).sum()) for k, v in before.items())
    return {**probe.result.as_dict(), "changed_frac": metrics["sync/changed_frac"],
            "changed_counted": changed / sum(v.numel() for v in before.values())}


def run(stages: list[int], out: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    report = {}
    for stage in stages:
        check, optimizer = linear(stage)
        report[stage] = {"linear": check, "optimizer": optimizer}
        if world == 1:  # the learner's ranks see different rows: their average is no rank's sum
            report[stage]["learner"] = learner(stage, rank, world)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, "stages": report}, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    run([int(s) for s in sys.argv[1].split(",")], sys.argv[2])
