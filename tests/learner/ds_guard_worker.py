"""Worker for the DeepSpeed guard test: run under torchrun (2 ranks) or directly (1 rank).

Applied step, then a step whose loss is NaN on the last rank only, then (ZeRO 0-2) one whose
loss is finite but one gradient inf, then an applied step: every rank must skip the bad ones
together with its weights and optimizer state bitwise unchanged. Rank 0 writes the verdict to
the file named by argv[2].
"""

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from rltt.learner import SKIP_REASON, AlgorithmConfig, Learner, LearnerConfig  # noqa: E402
from tests.learner.helpers import synthetic_batch, tiny_policy  # noqa: E402


def _state(learner):
    weights = {k: v.detach().float().clone() for k, v in learner.rollout_state_dict()[1].items()}
    inner = learner.backend.engine.basic_optimizer
    moments = [v.detach().clone() for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    return weights, moments


def _same(a, b) -> bool:
    return all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and len(a[1]) == len(b[1]) and \
        all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def run(stage: int, out: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per = 4 // world
    learner = Learner(tiny_policy(seed=0), LearnerConfig(backend="deepspeed", zero_stage=stage, lr=1e-2,
                                                          micro_batch_size=1, grad_clip=0.5),
                      AlgorithmConfig(), batch_size=per, max_len=8)
    share = lambda b: b.select(slice(rank * per, (rank + 1) * per))  # noqa: E731
    report = {"world": world, "steps": []}

    def step(batch, name):
        before = _state(learner)
        metrics = learner.update(batch)
        report["steps"].append({"name": name, "reason": metrics.get(SKIP_REASON), "version": learner.version,
                                "unchanged": _same(before, _state(learner))})

    step(share(synthetic_batch(seed=0)), "applied")
    bad = share(synthetic_batch(seed=1))
    if rank == world - 1:  # only the last rank sees a bad loss
        adv = bad.advantages.clone()
        adv[0] = float("nan")
        bad = dataclasses.replace(bad, advantages=adv)
    step(bad, "nan_loss")
    if stage < 3:  # ZeRO-3 partitions the parameters: no tensor hook on a full gradient
        weight = learner.policy.model.norm.weight
        hook = weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        step(share(synthetic_batch(seed=2)), "inf_grad")
        hook.remove()
    step(share(synthetic_batch(seed=3)), "applied_again")
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    run(int(sys.argv[1]), sys.argv[2])
