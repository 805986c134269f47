"""The learner's peak memory with LoRA against full fine-tuning, measured on the CPU at a small
looped shape, and each against its memory plan.

Measured: what the learner holds (parameters, the reference copy, AdamW's moments, fp32 masters:
tensor storages, each once) plus the peak of what its second update allocates and has not freed
(the torch profiler's allocator events, as tests/planning/test_learner_peak.py); planned: the plan's
learner phase less the process itself (``runtime``). The same recipe with and without
``learner.lora`` (rank 8 on every projection, shared by the loops).

    python bench/lora_memory.py [--checkpointing]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltt.model import LoopConfig, LoopedForCausalLM  # noqa: E402
from rltt.orchestration.components import make_learner  # noqa: E402
from rltt.orchestration.train_recipe import load_train_recipe  # noqa: E402
from rltt.planning import plan_run  # noqa: E402
from tests.planning.test_learner_peak import batch, created_peak  # noqa: E402

#: a block-heavy looped shape (T = 4, 6 layers, d = 256): 5.0 M parameters
FIELDS = dict(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
              num_loops=4, norm_placement="ouro", max_position_embeddings=256)
LORA = {"rank": 8, "alpha": 16}


def held_bytes(learner) -> int:
    """Bytes of the storages the learner keeps between updates (each storage once)."""
    seen, total = set(), 0
    tensors = list(learner.model.parameters())
    if learner.ref_model is not None:
        tensors += list(learner.ref_model.parameters())
    for state in learner.backend.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += list((getattr(learner.backend, "masters", None) or {}).values())
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def measure(lora: dict | None, checkpointing: bool) -> tuple[int, int]:
    """(measured, planned) learner-phase bytes of the tiny run, LoRA or full fine-tuning."""
    prompts, group, prompt_len, completion = 2, 2, 8, 4
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "config.json").write_text(yaml.safe_dump({"model_type": "rltt_looped", **FIELDS}))
        learner_cfg = {"backend": "torch", "dtype": "fp32", "micro_batch_size": group,
                       "activation_checkpointing": checkpointing}
        if lora:
            learner_cfg["lora"] = lora
        (tmp / "recipe.yaml").write_text(yaml.safe_dump({
            "model": {"path": str(tmp), "dtype": "fp32", "device": "cpu"},
            "data": {"source": "synthetic:quickstart", "max_prompt_tokens": prompt_len},
            "rollout": {"prompts_per_step": prompts, "group_size": group, "max_new_tokens": completion},
            "algorithm": {"track_kl": True}, "learner": learner_cfg, "logging": {"run_dir": str(tmp / "run")}}))
        recipe = load_train_recipe(tmp / "recipe.yaml", [])
        plan = plan_run(recipe, {"model_type": "rltt_looped", **FIELDS}, 8 << 30, device="cpu")
    torch.manual_seed(0)
    learner = make_learner(recipe, LoopedForCausalLM(LoopConfig(**FIELDS)))
    data = batch(FIELDS["vocab_size"], prompts, group, prompt_len, completion)
    learner.update(data)  # AdamW's moments exist from here on (the plan counts them as resident)
    measured = held_bytes(learner) + created_peak(lambda: learner.update(data))
    c = plan.components
    planned = plan.phases["learner"] - c["runtime"] - c["engine_copy"] - c["engine_fused"]  # no engine here
    return measured, planned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpointing", action="store_true", help="learner.activation_checkpointing=true")
    args = parser.parse_args()
    full, lora = measure(None, args.checkpointing), measure(LORA, args.checkpointing)
    mib = 1 << 20
    print(f"activation checkpointing {'on' if args.checkpointing else 'off'}")
    print(f"full fine-tuning: measured {full[0] / mib:.2f} MiB, planned {full[1] / mib:.2f} MiB "
          f"(plan / measured {full[1] / full[0]:.3f})")
    print(f"LoRA r=8 shared:  measured {lora[0] / mib:.2f} MiB, planned {lora[1] / mib:.2f} MiB "
          f"(plan / measured {lora[1] / lora[0]:.3f})")
    print(f"LoRA / full: measured {lora[0] / full[0]:.3f}, planned {lora[1] / full[1]:.3f}")


if __name__ == "__main__":
    main()
