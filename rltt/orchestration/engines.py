"""The rollout engines a recipe can name: a table ``{name: EngineSpec}``.

``rollout.engine``'s allowed values are this table's keys (`rltt.orchestration.train_recipe`),
so a new engine is one entry here: how to build it, which ``rollout.schedule`` values it runs,
and whether it can sample with the learner's own module in place. Whether its rollouts can be
replayed bitwise is a property of the engine (`RolloutEngine.replayable`), never of its name.

- ``native`` → `NativeEngine` on the given `LoopedForCausalLM` (in place: the engine and the
  learner may share it); every schedule; ``rollout.chunk_rows``, when an int, bounds the rows one
  batch of its passes holds (``auto`` and None: one batch per call); ``rollout.cuda_graphs``: its
  bucketed passes replayed as CUDA graphs (null: on with CUDA; true on CPU is a recipe error);
  ``rollout.attention``: ``sdpa`` or ``triton`` (`rltt.rollout.attention`; triton without a usable
  Triton is a recipe error); ``rollout.continuous_batching`` (true by default): a call of more rows than
  ``chunk_rows`` shares ``chunk_rows`` slots continuously, false: chunks of whole prompts. With ``learner.lora`` its model holds the adapters and applies them in
  every pass (the learner's own arithmetic, so replay stays bitwise); an update sends the adapters.
- ``vllm`` → `VllmEngine` (``rollout.vllm`` options) on the model (saved once for vLLM) or a
  checkpoint directory; dense schedule only. vLLM is imported only when one is built; without it
  the call is a one-line error with the install command. With ``learner.lora`` (shared adapters)
  it serves them through vLLM's own LoRA support and an update sends the adapters alone
  (``rollout.vllm.lora: adapters``, the default), or serves the base with the adapters merged in,
  all weights sent at each update (``rollout.vllm.lora: merged``).

How an engine applies a LoRA learner's adapters is `EngineSpec.adapters` of the rollout section,
one of `ADAPTER_MODES`; the learner's sync and the engine's construction follow from it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Callable, Mapping

from rltt.config import recipe_error
from rltt.rollout.attention import DEFAULT_ATTENTION
from rltt.rollout.engine import RolloutEngine
from rltt.rollout.params import SCHEDULES


def _get(section: Any, key: str, default: Any = None) -> Any:
    if isinstance(section, Mapping):
        return section.get(key, default)
    return getattr(section, key, default)


def vllm_options(section: Any) -> dict[str, Any]:
    """``rollout.vllm`` as `VllmEngine` keyword arguments (a dataclass, a mapping or None)."""
    options = _get(section, "vllm")
    if options is None:
        return {}
    options = asdict(options) if is_dataclass(options) else dict(options)
    options.pop("lora", None)  # how LoRA adapters are served: `EngineSpec.adapters`, not an engine option
    return options


def _native(rollout: Any, model_or_dir: Any, overrides: dict) -> RolloutEngine:
    from rltt.rollout.native import NativeEngine

    if isinstance(model_or_dir, RolloutEngine):
        return model_or_dir
    if not hasattr(model_or_dir, "config"):
        from rltt.model.load import load_looped

        model_or_dir = load_looped(model_or_dir)
    chunk_rows = _get(rollout, "chunk_rows")  # an int once `rltt train` resolved ``auto`` from its plan
    return NativeEngine(model_or_dir, chunk_rows if isinstance(chunk_rows, int) and not isinstance(chunk_rows, bool)
                        else None, cuda_graphs=_get(rollout, "cuda_graphs"),
                        attention=_get(rollout, "attention", DEFAULT_ATTENTION),
                        continuous=ENGINES["native"].continuous(rollout))


def _vllm(rollout: Any, model_or_dir: Any, overrides: dict) -> RolloutEngine:
    from rltt.vllm.vllm_engine import VllmEngine, recipe_sizing, require_vllm

    require_vllm()  # sized from the recipe (completion length, rows of a step) unless rollout.vllm sets it
    return VllmEngine(model_or_dir, **{**recipe_sizing(rollout), **vllm_options(rollout), **overrides})


#: how an engine applies a LoRA learner's adapters (`EngineSpec.adapters`):
#: ``model``: the model it samples with holds them (`rltt.model.adapters.attach_adapters`), shared or
#: one per loop step, and an update sends the adapter tensors alone; ``served``: it loads them as its
#: own LoRA (shared adapters only), an update sends the adapter tensors alone; ``merged``: it serves
#: the base with the shared adapters merged in, an update sends every weight
ADAPTER_MODES = ("model", "served", "merged")


def _vllm_adapters(rollout: Any) -> str:
    return "served" if _get(_get(rollout, "vllm"), "lora", "adapters") == "adapters" else "merged"


def _native_continuous(rollout: Any) -> bool:
    value = _get(rollout, "continuous_batching", True)
    if not isinstance(value, bool):
        raise recipe_error("rollout.continuous_batching", f"must be true or false, got {value!r}")
    return value


def _vllm_continuous(rollout: Any) -> bool:
    if _get(rollout, "continuous_batching", True) is not True:
        raise recipe_error("rollout.continuous_batching", "rollout.engine=vllm batches requests continuously its "
                                                          "own way; only the native engine can run chunks (false)")
    return True


@dataclass(frozen=True)
class EngineSpec:
    """An engine a recipe can name. ``build(rollout_section, model_or_dir, overrides)``;
    ``schedules``: the ``rollout.schedule`` values it runs (``why`` says why others not);
    ``in_place``: it can sample with the very module a learner trains (no copy, no weight sync)."""

    build: Callable[[Any, Any, dict], RolloutEngine]
    schedules: tuple[str, ...]
    in_place: bool
    why: str = ""
    #: ``adapters(rollout_section)``: how it applies a LoRA learner's adapters (`ADAPTER_MODES`)
    adapters: Callable[[Any], str] = lambda rollout: "model"
    #: ``continuous(rollout_section)``: whether a call's rows share the engine's row bound continuously (a
    #: finished row's slot taken by the next row) rather than in chunks — ``rollout.continuous_batching``
    #: read once, here, by the recipe check, the memory plan and the engine factory (a one-line error for
    #: a value the engine cannot run)
    continuous: Callable[[Any], bool] = lambda rollout: True

    def check_schedule(self, name: str, schedule: str) -> None:
        if schedule not in self.schedules:
            raise recipe_error("rollout.schedule", f"{self.why}, so rollout.engine={name} needs rollout.schedule="
                                                   f"{' | '.join(self.schedules)}, got {schedule!r}")


ENGINES: dict[str, EngineSpec] = {
    "native": EngineSpec(_native, schedules=SCHEDULES, in_place=True, continuous=_native_continuous),
    "vllm": EngineSpec(_vllm, schedules=("dense",), in_place=False, why="vLLM computes every step of every token",
                       adapters=_vllm_adapters, continuous=_vllm_continuous),
}


def engine_spec(name: str) -> EngineSpec:
    """The table entry of ``rollout.engine`` (a one-line error naming the key for an unknown name)."""
    if name not in ENGINES:
        raise recipe_error("rollout.engine", f"must be one of {' | '.join(ENGINES)}, got {name!r}")
    return ENGINES[name]


def make_engine(rollout: Any, model_or_dir: Any, **overrides) -> RolloutEngine:
    """The engine of a ``rollout`` recipe section (`RolloutSection` or a mapping with ``engine``
    and, for vLLM, ``vllm``). ``overrides`` go to the vLLM engine on top of ``rollout.vllm``."""
    name = _get(rollout, "engine", "native")
    spec = engine_spec(name)
    spec.check_schedule(name, _get(rollout, "schedule", "dense"))
    return spec.build(rollout, model_or_dir, overrides)
