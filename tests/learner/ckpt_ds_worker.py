"""Worker for the DeepSpeed activation-checkpointing test: run under torchrun (2 ranks) or
directly (1 rank). Each rank trains its shard of the same batches twice with the DeepSpeed
backend at ZeRO ``argv[1]`` — without, then with ``learner.activation_checkpointing`` — and rank 0
writes whether the metrics and the (gathered) parameters are bitwise equal to ``argv[2]``."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from rltt.learner import AlgorithmConfig, Learner, LearnerConfig  # noqa: E402
from tests.learner.helpers import synthetic_batch, tiny_policy  # noqa: E402

UNTIMED = ("time/", "throughput/", "memory/")


def train(stage: int, checkpointing: bool, rank: int, world: int):
    # learned loop weights need ZeRO 0-2; ZeRO-3 trains the mixture log-prob (the gate in the backward)
    algo = AlgorithmConfig(policy_logprob="rltt", omega="learned", kl_coef=0.1) if stage < 3 else \
        AlgorithmConfig(policy_logprob="mixture", kl_coef=0.1)
    model = tiny_policy(seed=0, num_hidden_layers=3)
    cfg = LearnerConfig(backend="deepspeed", zero_stage=stage, lr=1e-2, micro_batch_size=1, grad_clip=0.5,
                        activation_checkpointing=checkpointing)
    learner = Learner(model, cfg, algo, batch_size=4 // world, max_len=8)
    inner, calls = learner.policy.model, []  # count the checkpointed layer calls the engine's forwards make
    checkpoint = inner._gradient_checkpointing_func
    inner._gradient_checkpointing_func = lambda *args: calls.append(1) or checkpoint(*args)
    shard = slice(rank * 4 // world, (rank + 1) * 4 // world)
    metrics = [{k: v for k, v in learner.update(synthetic_batch(B=4, seed=s).select(shard)).items()
                if not k.startswith(UNTIMED)} for s in range(2)]
    state = {k: v.clone() for k, v in learner.rollout_state_dict()[1].items()}
    return metrics, state, learner.policy.is_gradient_checkpointing and len(calls) > 0


def run(stage: int, out: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    m0, s0, c0 = train(stage, False, rank, world)
    m1, s1, c1 = train(stage, True, rank, world)
    if rank == 0:
        params_diff = {k: float((s0[k].float() - s1[k].float()).abs().max()) for k in s0 if not torch.equal(s0[k], s1[k])}
        metrics_diff = [{k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)} for a, b in zip(m0, m1)]
        with open(out, "w") as f:
            json.dump({"world": world, "checkpointing": [c0, c1], "metrics_equal": m0 == m1,
                       "metrics_diff": metrics_diff, "params_equal": s0.keys() == s1.keys() and not params_diff,
                       "params_diff": params_diff}, f)
    import torch.distributed as dist

    if dist.is_initialized():  # no rank exits while the gloo group is alive
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    run(int(sys.argv[1]), sys.argv[2])
