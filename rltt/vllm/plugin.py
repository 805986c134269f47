"""vLLM plugin (entry point ``vllm.general_plugins`` → ``rltt = "rltt.vllm.plugin:register"``).

vLLM calls ``register()`` in every process it starts (engine core, workers), so a model
directory saved by rltt (``config.json`` with ``model_type: rltt_looped`` and architecture
``LoopedForCausalLM``) loads in any vLLM process once rltt is installed. Ouro checkpoints are
served by converting them once to rltt's layout (`rltt.vllm.vllm_engine` does it); their
remote-code config is not registered.
"""

from __future__ import annotations

ARCHITECTURES = {"LoopedForCausalLM": "rltt.vllm.model:LoopedVllmForCausalLM"}


def register() -> None:
    """Register rltt's config with transformers and its architecture with vLLM (idempotent)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from rltt.model.configuration import LoopConfig

    AutoConfig.register(LoopConfig.model_type, LoopConfig, exist_ok=True)
    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in ARCHITECTURES.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)
