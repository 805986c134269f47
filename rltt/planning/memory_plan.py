"""`plan_run`: the memory plan of a train recipe on a device, from the model's config.json alone.

The training loop calls it before it loads the model; ``rltt plan`` prints it. A `MemoryPlan`
holds the per-device bytes of every component (`rltt.planning.footprint`), the two phases'
peaks, the rollout chunk (`rltt.planning.chunking`) and the verdict: it fits when both phases fit
in ``budget_bytes`` (the device less ``train.memory_headroom``) with at least one group of rows
per chunk; otherwise ``problem`` is one line naming the recipe
keys to change (`rltt.planning.advice`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rltt.planning import footprint as comp
from rltt.planning.advice import problem_line
from rltt.planning.chunking import chunks_per_step
from rltt.planning.engine_memory import engine_memory
from rltt.planning.held_rows import host_terms
from rltt.planning.run_settings import RunSettings
from rltt.planning.shapes import ModelShape, model_shape


@dataclass
class MemoryPlan:
    """The plan of one run on one device (bytes are per device)."""

    fits: bool
    device: str
    device_bytes: int
    gpus: int
    model_kind: str
    parameters: int
    trained_parameters: int  # what the optimizer trains: every parameter, or the LoRA adapters
    loops: int
    layers: int
    train_dtype: str
    engine: str
    kv_bytes_per_token: int  # rollout KV per (row, position), all T·L slots, in the engine's dtype
    prompt_tokens: int
    completion_tokens: int
    rows_per_rank: int  # rollout rows one rank samples per step
    micro_batch_rows: int
    checkpointing: bool
    rollout_rows_per_chunk: int  # 0: not even one group fits
    chunk_rows_setting: int | str
    components: dict[str, int]  # allocated bytes (runtime: the CUDA context and library workspaces)
    phases: dict[str, int]
    headroom: float  # train.memory_headroom: the share of the device left free for what the allocator reserves
    budget_bytes: int  # what the phases may fill: device_bytes × (1 - headroom)
    problem: str | None = None
    notes: list[str] = field(default_factory=list)
    host: dict[str, int] = field(default_factory=dict)  # host memory outside the device phases (`held_rows`)

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def peak_bytes(self) -> int:
        return max(self.phases.values())

    @property
    def chunks_per_step(self) -> int:
        return chunks_per_step(self.rows_per_rank, self.rollout_rows_per_chunk)

    def to_json(self) -> dict:
        return {
            "fits": self.fits, "device": self.device, "device_bytes": self.device_bytes, "gpus": self.gpus,
            "model_kind": self.model_kind, "parameters": self.parameters,
            "trained_parameters": self.trained_parameters, "loops": self.loops, "layers": self.layers,
            "train_dtype": self.train_dtype, "engine": self.engine, "kv_bytes_per_token": self.kv_bytes_per_token,
            "sequence_tokens": self.sequence_tokens, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "rows_per_rank": self.rows_per_rank,
            "micro_batch_rows": self.micro_batch_rows, "activation_checkpointing": self.checkpointing,
            "rollout_rows_per_chunk": self.rollout_rows_per_chunk, "chunk_rows_setting": self.chunk_rows_setting,
            "chunks_per_step": self.chunks_per_step, "components": dict(self.components), "phases": dict(self.phases),
            "peak_bytes": self.peak_bytes, "headroom": self.headroom, "budget_bytes": self.budget_bytes,
            "problem": self.problem, "notes": list(self.notes), "host": dict(self.host),
        }


def recipe_device(recipe) -> str:
    """``cuda`` or ``cpu``: where ``model.device`` puts the run (``auto``: a GPU when there is one)."""
    device = recipe.model.device
    if device == "cpu":
        return "cpu"
    if device.startswith("cuda"):
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def plan_run(recipe, model_config_dict: dict, device_bytes: int, gpus: int = 1,
             device: str | None = None) -> MemoryPlan:
    """The memory plan of ``recipe`` (a `TrainRecipe`) for the model whose config.json holds
    ``model_config_dict``, on devices of ``device_bytes`` each, ``gpus`` data-parallel ranks.
    ``device``: ``cuda`` | ``cpu`` (default: where ``model.device`` puts the run). Pure: nothing is
    loaded or allocated."""
    device = device or recipe_device(recipe)
    shape = model_shape(model_config_dict, recipe.model.convert)
    settings = RunSettings.from_recipe(recipe, device, gpus)
    plan = plan_settings(shape, settings, device_bytes)
    plan.host = host_terms(recipe, plan.sequence_tokens, shape.loops)
    if not plan.fits:
        plan.problem = problem_line(shape, settings, device_bytes, plan, plan_settings)
    return plan


def plan_settings(shape: ModelShape, s: RunSettings, device_bytes: int) -> MemoryPlan:
    """The plan for already extracted settings (no verdict line: see `plan_run`)."""
    notes = []
    if s.lora:  # the adapters as the learner attaches them (`rltt.model.adapters`)
        shape = replace(shape, lora_rank=s.lora_rank, lora_targets=s.lora_targets, lora_per_loop=s.lora_per_loop)
        notes.append(f"LoRA (learner.lora): rank {s.lora_rank} on {', '.join(s.lora_targets)}, "
                     f"{'one adapter per loop step' if s.lora_per_loop else 'one adapter shared by all loops'}: "
                     f"{shape.adapter_parameters:,} trained parameters; optimizer, master weights and gradients "
                     f"are the adapters' only; no reference copy (the reference is the base with adapters off)")
    if s.prompt_tokens >= shape.max_positions:  # the engine rejects longer prompts
        s = replace(s, prompt_tokens=shape.max_positions - 1)
        notes.append(f"data.max_prompt_tokens is capped at the model's {shape.max_positions} positions minus one")
    resident = comp.resident(shape, s, device_bytes)
    base = sum(resident.values())
    budget = s.budget_bytes(device_bytes)  # all but train.memory_headroom

    def rollout_fits(rows: int) -> bool:
        return base + sum(comp.rollout(shape, s, rows, device_bytes).values()) <= budget

    engine = engine_memory(s.engine)
    rows, note = engine.chunk_rows(s, rollout_fits)
    for line in (note, engine.note(shape, s)):
        if line:
            notes.append(line)
    shown_rows = rows or min(s.group_size, s.rows_per_rank)
    components = {**resident, **comp.rollout(shape, s, shown_rows, device_bytes), **comp.learner(shape, s)}
    components = {k: components[k] for k in comp.ORDER}
    phases = comp.phases(components, comp.held_activations(shape, s))
    fits = rows > 0 and all(v <= budget for v in phases.values())
    positions, _, keys = s.learner_positions()
    if keys is None:
        notes.append(f"activations: the padded micro-batch, {positions} positions (every row's prompt + "
                     f"completion; learner.pack_sequences=true computes a group's prompt once)")
    else:
        notes.append(f"activations: the packed micro-batch, {positions} positions (each of its "
                     f"{s.micro_prompts} prompt(s) once, then every row's completion)")
    return MemoryPlan(
        fits=fits, device=s.device, device_bytes=device_bytes, gpus=s.gpus, model_kind=shape.kind,
        parameters=shape.parameters, trained_parameters=comp.trained_parameters(shape, s), loops=shape.loops,
        layers=shape.layers,
        train_dtype="bf16" if s.train_bytes == 2 else "fp32", engine=s.engine,
        kv_bytes_per_token=shape.kv_bytes_per_token(s.engine_bytes),
        prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens, rows_per_rank=s.rows_per_rank,
        micro_batch_rows=s.micro_rows, checkpointing=s.checkpointing, rollout_rows_per_chunk=rows,
        chunk_rows_setting=s.chunk_rows, components=components, phases=phases, headroom=s.headroom,
        budget_bytes=budget, notes=notes)


def plan_here(recipe, gpus: int = 1, device_index: int = 0) -> MemoryPlan:
    """The plan of ``recipe`` on this machine, as `rltt train` makes it before loading anything:
    the model's config.json alone, against the GPU's total memory (``model.device`` on CUDA) or
    the memory available now (on the CPU), ``gpus`` ranks sharing the run."""
    from rltt.planning.sources import available_cpu_bytes, gpu_bytes, model_config

    device = recipe_device(recipe)
    config, _ = model_config(recipe.model.path)
    device_bytes = gpu_bytes(device_index) if device == "cuda" else None
    return plan_run(recipe, config, device_bytes or available_cpu_bytes(), gpus=gpus,
                    device=device if device_bytes else "cpu")
