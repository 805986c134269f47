"""Worker for the LoRA DeepSpeed test (one process, CPU/gloo): a LoRA learner under DeepSpeed ZeRO
``argv[1]`` against the torch backend on the same batches; writes the verdict to ``argv[2]``."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from rltt.learner import AlgorithmConfig, Learner, LearnerConfig  # noqa: E402
from rltt.learner.settings import LoraSection  # noqa: E402
from rltt.model.adapters import is_adapter  # noqa: E402
from tests.learner.helpers import synthetic_batch, tiny_policy  # noqa: E402


def run(stage: int, out: str) -> None:
    algo = AlgorithmConfig(kl_coef=0.1)
    batches = [synthetic_batch(B=4, seed=s) for s in range(3)]
    cfg = dict(lr=1e-2, micro_batch_size=2, grad_clip=0.5, lora=LoraSection(rank=4, alpha=8.0))
    base = {k: v.clone() for k, v in tiny_policy(0).state_dict().items()}
    learner = Learner(tiny_policy(0), LearnerConfig(backend="deepspeed", zero_stage=stage, **cfg), algo, batch_size=4,
                      max_len=8)
    trained = sum(getattr(p, "ds_numel", p.numel()) for p in learner.model.parameters() if p.requires_grad)
    ds_metrics = [learner.update(b) for b in batches]
    ds_losses = [m["loss/total"] for m in ds_metrics]
    _, sent = learner.rollout_state_dict()
    full = {k: v.clone() for k, v in learner.backend.full_state_dict(learner.policy).items()}
    # the checkpoint holds the adapters and their state, not the base; a rebuilt learner resumes from it exactly
    learner.save(os.path.join(os.path.dirname(out), "ckpt"))
    import glob

    saved = [name for file in glob.glob(os.path.join(os.path.dirname(out), "ckpt", "**", "*model_states.pt"),
                                        recursive=True)
             for name in torch.load(file, weights_only=False)["module"]]  # DeepSpeed's own file (a test reads it)
    resumed = Learner(tiny_policy(0), LearnerConfig(backend="deepspeed", zero_stage=stage, **cfg), algo, batch_size=4,
                      max_len=8)
    resumed.load(os.path.join(os.path.dirname(out), "ckpt"))
    more = synthetic_batch(B=4, seed=7)
    learner.update(more)
    resumed.update(more)
    after, again = learner._adapter_tensors(), resumed._adapter_tensors()
    torch_model = tiny_policy(0)
    ref = Learner(torch_model, LearnerConfig(backend="torch", **cfg), algo, batch_size=4, max_len=8)
    torch_metrics = [ref.update(b) for b in batches]
    torch_losses = [m["loss/total"] for m in torch_metrics]
    ref_state = torch_model.state_dict()
    result = {
        "ds_losses": ds_losses, "torch_losses": torch_losses,
        "ds_changed": [m["sync/changed_frac"] for m in ds_metrics],
        "torch_changed": [m["sync/changed_frac"] for m in torch_metrics],
        "adapter_diff": max((full[k].float() - ref_state[k].float()).abs().max().item()
                            for k in ref_state if is_adapter(k)),
        "base_equal": all(torch.equal(full[k], v) for k, v in base.items()),
        "sent_adapters_only": bool(sent) and all(is_adapter(k) for k in sent),
        "resumed_equal": all(torch.equal(after[k], again[k]) for k in after), "deepspeed_module": saved,
        "trained": trained, "adapters": sum(v.numel() for k, v in ref_state.items() if is_adapter(k)),
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    run(int(sys.argv[1]), sys.argv[2])
