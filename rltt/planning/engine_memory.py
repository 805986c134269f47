"""What each rollout engine holds on the device, as a table the plan reads (`ENGINE_MEMORY`,
keyed like ``rollout.engine``):

- **native**: its own copy of the weights in the engine's dtype, unless it samples with the torch
  learner's own tensors (`NativeMemory.shares_model`), and, per chunk of rows, the KV cache, state
  and workspace it preallocates (`rltt.planning.rollout_memory`); the plan picks the rows per chunk
  (``rollout.chunk_rows``) and frees them before the learner runs.
- **vllm**: its share of the device — ``gpu_memory_utilization`` × device memory on a GPU,
  ``kv_cache_gb`` plus its copy of the weights on the CPU — inside which it keeps its KV cache and
  batches the step's rows itself; the plan can lower its share to make room (`memory_changes`).

A new engine adds a row here; the plan, its table and its advice do not branch on engine names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from rltt.errors import RlttError
from rltt.planning import rollout_memory as rm
from rltt.planning.chunking import largest_fitting_rows

if TYPE_CHECKING:
    from rltt.planning.run_settings import RunSettings
    from rltt.planning.shapes import ModelShape

GIB = 1 << 30  # the plan's unit (`rltt.planning.footprint` reads it from here)
#: the rollout terms of the plan (`rltt.planning.footprint.ROLLOUT`)
ROLLOUT = ("rollout_kv", "rollout_state", "rollout_workspace")


@dataclass(frozen=True)
class NativeMemory:
    """rltt's engine: preallocated buffers per chunk of rows, a weight copy unless shared."""

    def shares_model(self, s: "RunSettings") -> bool:
        """`rltt.orchestration.components.shares_model`: the native engine samples with the torch
        learner's own tensors when the learner keeps the model's dtype."""
        return s.backend == "torch" and s.learner_dtype == s.model_dtype

    def resident(self, shape: "ModelShape", s: "RunSettings", device_bytes: int) -> dict[str, int]:
        return {"engine_copy": 0 if self.shares_model(s) else s.engine_bytes * shape.parameters, "vllm": 0}

    def rollout(self, shape: "ModelShape", s: "RunSettings", rows: int) -> dict[str, int]:
        if rows <= 0:
            return dict.fromkeys(ROLLOUT, 0)
        b, seq = s.engine_bytes, s.sequence_tokens
        return {
            "rollout_kv": rm.kv_bytes(shape, rows, seq, b),
            "rollout_state": rm.state_bytes(shape, rows, seq, b),
            "rollout_workspace": rm.workspace_bytes(shape, rows, s.group_size, s.prompt_tokens, b, s.top_p, s.top_k),
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

    def resident(self, shape: "ModelShape", s: "RunSettings", device_bytes: int) -> dict[str, int]:
        if s.device == "cuda":
            share = int(s.vllm_utilization * device_bytes)
        else:
            share = int(s.vllm_kv_gb * GIB) + s.engine_bytes * shape.parameters
        return {"engine_copy": 0, "vllm": share}

    def rollout(self, shape: "ModelShape", s: "RunSettings", rows: int) -> dict[str, int]:
        return dict.fromkeys(ROLLOUT, 0)  # inside its share

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
