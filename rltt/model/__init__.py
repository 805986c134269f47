"""The looped language model: config, forward, KV cache, exits, conversion and Ouro import."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from rltt.model.loop_cache import LoopCache
from rltt.model.configuration import LoopConfig
from rltt.model.exits import ExitPolicy, exit_distribution
from rltt.model.modeling import LoopedForCausalLM, LoopedModel, LoopOutput

AutoConfig.register(LoopConfig.model_type, LoopConfig, exist_ok=True)
AutoModel.register(LoopConfig, LoopedModel, exist_ok=True)
AutoModelForCausalLM.register(LoopConfig, LoopedForCausalLM, exist_ok=True)

from rltt.model.dense_to_loop import loopify  # noqa: E402
from rltt.model.load import load_looped  # noqa: E402
from rltt.model.ouro import load_ouro  # noqa: E402


__all__ = [
    "ExitPolicy",
    "LoopCache",
    "LoopConfig",
    "LoopOutput",
    "LoopedForCausalLM",
    "LoopedModel",
    "exit_distribution",
    "load_looped",
    "load_ouro",
    "loopify",
]
