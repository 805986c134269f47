"""vLLM's LoRA as the vLLM engine uses it (vLLM-free, so the memory plan can read it).

vLLM serves an adapter from a PEFT folder through its LoRA layers: each adapted projection holds
slots of ``max_loras`` adapters padded to ``max_lora_rank``, one of vLLM's allowed ranks
(`VLLM_LORA_RANKS`), and the loaded adapters are also kept in a CPU cache. The engine serves one
adapter at a time (``max_loras = 1``) at the smallest allowed rank that holds the recipe's.
"""

from __future__ import annotations

from rltt.errors import RlttError

#: vLLM 0.32's allowed ``max_lora_rank`` values (``vllm.config.lora.MaxLoRARanks``)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def rank_problem(rank: int) -> str | None:
    """Why vLLM cannot serve a rank-``rank`` adapter (None: it can); said of ``learner.lora.rank``."""
    if rank > VLLM_LORA_RANKS[-1]:
        return (f"vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}, got {rank} "
                f"(rollout.vllm.lora: merged serves any rank)")
    return None


def lora_slot_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds a rank-``rank`` adapter."""
    problem = rank_problem(rank)
    if problem:
        raise RlttError(f"learner.lora.rank: {problem}")
    return next(allowed for allowed in VLLM_LORA_RANKS if allowed >= rank)


def check_served_adapters(spec) -> None:
    """One-line errors for adapters vLLM's LoRA cannot serve: one per loop step (a vLLM layer
    applies one adapter per request, whatever the loop step) or a rank above vLLM's largest."""
    if spec.per_loop:
        raise RlttError("rollout.engine=vllm: per-loop adapters (learner.lora.per_loop: true) differ between loop "
                        "steps, and vLLM applies one adapter per request to every step (use per_loop: false or "
                        "rollout.engine: native)")
    lora_slot_rank(spec.rank)
