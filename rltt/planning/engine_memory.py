"""What each rollout engine holds on the device, as a table the plan reads (`ENGINE_MEMORY`,
keyed like ``rollout.engine``):

- **native**: its own copy of the weights in the engine's dtype, unless it samples with the torch
  learner's own tensors (`NativeMemory.shares_model`), the concatenated q/k/v weights its model
  keeps for decoding (``engine_fused``, `rltt.model.layers.FusedWeights`), with CUDA graphs its
  buckets' buffers and graph pool (``engine_graphs``, `rltt.planning.graph_memory`), and, per chunk of rows,
  the KV cache, state and workspace it preallocates (`rltt.planning.rollout_memory`); the plan picks
  the rows per chunk (``rollout.chunk_rows``) and frees them before the learner runs.
- **vllm**: its share of the device — ``gpu_memory_utilization`` × device memory on a GPU,
  ``kv_cache_gb`` plus its copy of the weights on the CPU — inside which it keeps its KV cache and
  batches the step's rows itself. Its weights in a LoRA run (`VllmMemory.weights`): the base, and
  with ``rollout.vllm.lora: adapters`` the loaded adapter (its CPU cache) and its LoRA layers'
  adapter slot (`rltt.planning.shapes.ModelShape.vllm_lora_slot_parameters`, at the padded rank of
  `rltt.vllm.lora.lora_slot_rank`); merged, the base alone; the plan can lower its share to make room (`memory_changes`).
  Asleep (``rollout.vllm.sleep``, on by default with CUDA) it holds through the learner phase only
  what sleep level 1 keeps (`VLLM_ASLEEP`); the rest of its share (``vllm_woken``) counts in the
  rollout phase alone.

What vLLM 0.32's sleep level 1 does (``CuMemAllocator.sleep`` via the ``cumem`` sleep backend):
every allocation made inside its sleep allocator's pools is unmapped — the ``weights`` (and
``runtime`` KV-init state) after a copy to pinned CPU memory, the ``kv_cache`` and ``workspace``
pools dropped — then ``torch.cuda.empty_cache()`` hands the caching allocator's free blocks back.
The CPU copy of the weights is host memory, not GPU memory. What stays on the GPU is what was
allocated outside those pools: the CUDA graphs' memory pool (a private pool of torch's caching
allocator, captured at start-up unless ``enforce_eager``; vLLM logs its size as "CUDA graph pool
memory"), the model runner's persistent input/sampler buffers, and, with ``multiprocess``, the
engine core's own CUDA context. None of these has been measured here: `VLLM_ASLEEP` holds
allowances.

A new engine adds a row here; the plan, its table and its advice do not branch on engine names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from rltt.errors import RlttError
from rltt.planning import rollout_memory as rm
from rltt.planning.chunking import largest_fitting_rows
from rltt.planning.graph_memory import engine_graphs_bytes

if TYPE_CHECKING:
    from rltt.planning.run_settings import RunSettings
    from rltt.planning.shapes import ModelShape

from rltt.telemetry.schema import GIB  # the plan's unit (`rltt.planning.footprint` reads it from here)
#: the rollout terms of the plan (`rltt.planning.footprint.ROLLOUT`)
ROLLOUT = ("rollout_kv", "rollout_state", "rollout_workspace", "vllm_woken")

#: what a vLLM engine asleep at level 1 still holds on the GPU (module docstring): an allowance in
#: bytes per item and whether it applies to the run's settings. Unmeasured: a GPU run replaces them.
VLLM_ASLEEP = {
    "CUDA graph pool and persistent buffers": (GIB, lambda s: not s.vllm_eager),
    "the engine process's CUDA context": (GIB, lambda s: s.vllm_multiprocess),
}


def vllm_asleep_bytes(s: "RunSettings") -> int:
    """What a sleeping vLLM engine keeps on the GPU under ``s`` (`VLLM_ASLEEP`)."""
    return sum(size for size, applies in VLLM_ASLEEP.values() if applies(s))


@dataclass(frozen=True)
class NativeMemory:
    """rltt's engine: preallocated buffers per chunk of rows, a weight copy unless shared."""

    def shares_model(self, s: "RunSettings") -> bool:
        """`rltt.orchestration.components.shares_model`: the native engine samples with the torch
        learner's own tensors when the learner keeps the model's dtype."""
        return s.backend == "torch" and s.learner_dtype == s.model_dtype

    def resident(self, shape: "ModelShape", s: "RunSettings", device_bytes: int) -> dict[str, int]:
        return {"engine_copy": 0 if self.shares_model(s) else s.engine_bytes * shape.parameters,
                "engine_fused": s.engine_bytes * shape.fused_parameters,
                "engine_graphs": engine_graphs_bytes(shape, s.engine_bytes, capture=True, attention=s.attention)
                if s.cuda_graphs else 0,
                "vllm": 0}

    def note(self, shape: "ModelShape", s: "RunSettings") -> str | None:
        return None

    def rollout(self, shape: "ModelShape", s: "RunSettings", rows: int, device_bytes: int) -> dict[str, int]:
        if rows <= 0:
            return dict.fromkeys(ROLLOUT, 0)
        b, seq = s.engine_bytes, s.sequence_tokens
        if s.continuous and rows < s.rows_per_rank:  # one executor of ``rows`` slots for the whole call
            return {
                "rollout_kv": rm.kv_bytes(shape, rows, seq, b),
                "rollout_state": rm.state_bytes(shape, rows, seq, b)
                + rm.held_bytes(shape, s.rows_per_rank, s.completion_tokens),
                "rollout_workspace": rm.continuous_workspace_bytes(shape, rows, s.group_size, s.prompt_tokens, b,
                                                                   s.top_p, s.top_k),
                "vllm_woken": 0,
            }
        return {
            "rollout_kv": rm.kv_bytes(shape, rows, seq, b),
            "rollout_state": rm.state_bytes(shape, rows, seq, b),
            "rollout_workspace": rm.workspace_bytes(shape, rows, s.group_size, s.prompt_tokens, b, s.top_p, s.top_k),
            "vllm_woken": 0,
        }

    def chunk_rows(self, s: "RunSettings", fits: Callable[[int], bool]) -> tuple[int, str | None]:
        """Rows per rollout chunk (``auto``: the most whole groups that fit) and a note for the plan."""
        if s.chunk_rows == "auto":
            return largest_fitting_rows(fits, s.group_size, s.rows_per_rank), None
        return min(int(s.chunk_rows), s.rows_per_rank), None

    def memory_changes(self, s: "RunSettings") -> Iterator[dict]:
        return iter(())

    def chunk_label(self, rows: int) -> str:
        return f"{rows} rows per chunk" if rows else "not even one group fits"

    def chunk_line(self, rows: int, rows_per_rank: int, setting: str, chunks: int) -> str | None:
        return f"rollout chunk: {rows} rows ({setting}; {chunks} chunk(s) per step)" if rows else None


@dataclass(frozen=True)
class VllmMemory:
    """vLLM: a share of the device that holds its KV cache; it batches the step's rows itself."""

    #: the shares `memory_changes` offers, highest first
    utilizations: tuple[float, ...] = (0.4, 0.3, 0.2)

    def shares_model(self, s: "RunSettings") -> bool:
        return False

    def weights(self, shape: "ModelShape", s: "RunSettings") -> int:
        """The parameters it holds: the model's; in a LoRA run the base, plus with served adapters
        one loaded adapter and the adapter slot of its LoRA layers (module docstring)."""
        if not s.lora:
            return shape.parameters
        base = shape.parameters - shape.adapter_parameters
        if s.vllm_lora == "merged":
            return base
        from rltt.vllm.lora import lora_slot_rank

        return base + shape.adapter_parameters + shape.vllm_lora_slot_parameters(lora_slot_rank(s.lora_rank))

    def share(self, shape: "ModelShape", s: "RunSettings", device_bytes: int) -> int:
        """Its share awake: ``gpu_memory_utilization`` × the GPU (its weights inside it), or its KV
        space and weights on the CPU."""
        if s.device == "cuda":
            return int(s.vllm_utilization * device_bytes)
        return int(s.vllm_kv_gb * GIB) + s.engine_bytes * self.weights(shape, s)

    def held(self, shape: "ModelShape", s: "RunSettings", device_bytes: int) -> int:
        """What it holds through the learner phase: the whole share, or asleep what sleep keeps."""
        share = self.share(shape, s, device_bytes)
        return min(share, vllm_asleep_bytes(s)) if s.vllm_sleep else share

    def resident(self, shape: "ModelShape", s: "RunSettings", device_bytes: int) -> dict[str, int]:
        return {"engine_copy": 0, "engine_fused": 0, "engine_graphs": 0, "vllm": self.held(shape, s, device_bytes)}

    def rollout(self, shape: "ModelShape", s: "RunSettings", rows: int, device_bytes: int) -> dict[str, int]:
        woken = self.share(shape, s, device_bytes) - self.held(shape, s, device_bytes)  # mapped back to sample
        return {**dict.fromkeys(ROLLOUT, 0), "vllm_woken": woken}  # its KV lives inside its share

    def note(self, shape: "ModelShape", s: "RunSettings") -> str | None:
        if not s.vllm_sleep:
            return ("rollout.vllm.sleep off: vLLM's whole share stays on the device through the learner phase"
                    if s.device == "cuda" else None)
        kept = ", ".join(f"{what} {size / GIB:.1f} GiB" for what, (size, applies) in VLLM_ASLEEP.items()
                         if applies(s)) or "nothing counted"
        return (f"rollout.vllm.sleep: vLLM sleeps (level 1) through the learner phase — its weights go to pinned "
                f"CPU memory ({s.engine_bytes * self.weights(shape, s) / GIB:.2f} GiB of host RAM, not GPU memory), its "
                f"KV cache is dropped; it keeps {kept} (allowances, not measured)")

    def chunk_rows(self, s: "RunSettings", fits: Callable[[int], bool]) -> tuple[int, str | None]:
        return s.rows_per_rank, ("rollout.engine=vllm: its KV cache is inside its gpu_memory_utilization share "
                                 "and it batches rows itself")

    def memory_changes(self, s: "RunSettings") -> Iterator[dict]:
        if s.device == "cuda":
            for util in self.utilizations:
                if util < s.vllm_utilization:
                    yield {"vllm_utilization": util}

    def chunk_label(self, rows: int) -> str:
        return "vLLM"

    def chunk_line(self, rows: int, rows_per_rank: int, setting: str, chunks: int) -> str | None:
        return f"rollout: vLLM batches the step's {rows_per_rank} rows itself (rollout.chunk_rows unused)"


#: rollout.engine -> what it holds (every engine of `rltt.rollout`'s table has a row: tests/planning)
ENGINE_MEMORY = {"native": NativeMemory(), "vllm": VllmMemory()}


def engine_memory(name: str):
    """The memory model of ``rollout.engine`` = ``name``."""
    try:
        return ENGINE_MEMORY[name]
    except KeyError:
        raise RlttError(f"rollout.engine={name!r}: the memory plan knows no such engine "
                        f"(one of {', '.join(ENGINE_MEMORY)})") from None
