"""`make_engine`: the rollout engine a recipe's ``rollout`` section asks for.

``rollout.engine: native`` → `NativeEngine` on the given `LoopedForCausalLM` (in place: the
engine and the learner may share it); ``vllm`` → `VllmEngine` (``rollout.vllm`` options) on the
model (saved once for vLLM) or a checkpoint directory. vLLM is imported only for ``vllm``; without
it the call is a one-line error with the install command.
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any, Mapping

from rltt.config import recipe_error
from rltt.rollout.engine import RolloutEngine

ENGINES = ("native", "vllm")


def _get(section: Any, key: str, default: Any = None) -> Any:
    if isinstance(section, Mapping):
        return section.get(key, default)
    return getattr(section, key, default)


def vllm_options(section: Any) -> dict[str, Any]:
    """``rollout.vllm`` as `VllmEngine` keyword arguments (a dataclass, a mapping or None)."""
    options = _get(section, "vllm")
    if options is None:
        return {}
    if is_dataclass(options):
        return asdict(options)
    return dict(options)


def make_engine(rollout: Any, model_or_dir: Any, **overrides) -> RolloutEngine:
    """The engine of a ``rollout`` recipe section (`RolloutSection` or a mapping with ``engine``
    and, for vLLM, ``vllm``). ``overrides`` go to the vLLM engine on top of ``rollout.vllm``."""
    engine = _get(rollout, "engine", "native")
    if engine == "native":
        from rltt.rollout.native import NativeEngine

        if isinstance(model_or_dir, RolloutEngine):
            return model_or_dir
        if not hasattr(model_or_dir, "config"):
            from rltt.model.load import load_looped

            model_or_dir = load_looped(model_or_dir)
        return NativeEngine(model_or_dir)
    if engine == "vllm":
        from rltt.vllm.engine import VllmEngine, require_vllm

        require_vllm()
        schedule = _get(rollout, "schedule", "dense")
        if schedule != "dense":
            raise recipe_error("rollout.schedule", f"vLLM computes every step of every token, so rollout.engine=vllm "
                                                   f"needs rollout.schedule=dense, got {schedule!r}")
        return VllmEngine(model_or_dir, **{**vllm_options(rollout), **overrides})
    raise recipe_error("rollout.engine", f"must be one of {' | '.join(ENGINES)}, got {engine!r}")
