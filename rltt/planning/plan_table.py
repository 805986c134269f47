"""The plan as text: an aligned table of the per-device components (GiB, allocated bytes), the
phases' peaks against the usable share (the device less ``train.memory_headroom``), which figures
are allocated and what the allocator may reserve beyond them, the rollout chunk and the verdict."""

from __future__ import annotations

from rltt.planning.engine_memory import engine_memory
from rltt.planning.footprint import GIB, LEARNER, RESIDENT, ROLLOUT

LABELS = {
    "runtime": "CUDA context / process",
    "weights": "policy weights",
    "reference": "reference model",
    "engine_copy": "engine copy of the weights",
    "engine_fused": "engine fused q/k/v weights",
    "engine_graphs": "engine CUDA-graph buckets and pool",
    "vllm": "vLLM held in the update",
    "optimizer": "optimizer moments (AdamW)",
    "master_weights": "fp32 master weights",
    "grad_buffers": "DeepSpeed gradient buffers",
    "rollout_kv": "rollout KV",
    "rollout_state": "rollout carry/gates/tokens",
    "rollout_workspace": "sampling / prefill workspace",
    "vllm_woken": "vLLM woken (weights + KV)",
    "gradients": "gradients",
    "reduce_bucket": "reduce bucket (backward)",
    "loop_gradients": "loop-summed block gradients",
    "activations": "activations (one micro-batch)",
    "logits_workspace": "log-prob kernel workspace",
    "step_workspace": "optimizer-step workspace",
}

#: host-memory lines (`MemoryPlan.host`), outside the device phases
HOST_LABELS = {"held_ahead": "rows held ahead (K steps)", "partial_buffer": "partial rollouts in progress"}


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def format_plan(plan, title: str = "") -> str:
    width = max(len(label) for label in LABELS.values()) + 2
    lines = []
    if title:
        lines.append(title)
    lines += [
        f"model: {plan.model_kind}, {plan.parameters:,} parameters, T={plan.loops} loops × L={plan.layers} layers, "
        f"trained in {plan.train_dtype}"
        + ("" if plan.trained_parameters == plan.parameters else
           f"; {plan.trained_parameters:,} of them trained (LoRA adapters)"),
        f"device: {plan.device}, {plan.device_bytes / GIB:.2f} GiB per device × {plan.gpus}",
        f"rows: {plan.rows_per_rank} rollout rows per step per rank, {plan.prompt_tokens} prompt + "
        f"{plan.completion_tokens} completion = {plan.sequence_tokens} positions each; learner micro-batch "
        f"{plan.micro_batch_rows} rows, activation checkpointing {'on' if plan.checkpointing else 'off'}",
        f"rollout KV per token: {plan.kv_bytes_per_token:,} bytes (all {plan.loops * plan.layers} (loop, layer) slots)",
        "",
        f"{'component':<{width}}{'GiB':>8}  phase",
    ]
    lines[-1] = f"{'component (allocated bytes)':<{width}}{'GiB':>8}  phase"
    for group, phase in ((RESIDENT, "both"), (ROLLOUT, "rollout"), (LEARNER, "learner")):
        for key in group:
            value = plan.components.get(key, 0)
            if value or key in ("weights", "reference", "gradients", "optimizer", "activations", "rollout_kv"):
                lines.append(f"{LABELS[key]:<{width}}{_gib(value)}  {phase}")
    rows = plan.rollout_rows_per_chunk
    engine = engine_memory(plan.engine)
    chunk = engine.chunk_label(rows)
    lines += [
        "",
        f"{'rollout phase peak':<{width}}{_gib(plan.phases['rollout'])}  ({chunk})",
        f"{'learner phase peak':<{width}}{_gib(plan.phases['learner'])}",
        f"{'peak':<{width}}{_gib(plan.peak_bytes)}  of {plan.budget_bytes / GIB:.2f} GiB usable",
        f"{'headroom':<{width}}{_gib(plan.device_bytes - plan.budget_bytes)}  left free "
        f"(train.memory_headroom={plan.headroom:g} of {plan.device_bytes / GIB:.2f} GiB)",
        "",
        "allocated vs reserved: every component above is allocated bytes (torch.cuda.memory_allocated "
        "counts them; the CUDA context row is outside it); the caching allocator may reserve more "
        "(torch.cuda.memory_reserved: fragmentation, cached free blocks), which the headroom is left for",
    ]
    if plan.device == "cuda":
        lines.append("(measured on an H200, gsm8k.yaml's phases on an emulated 80 GB card: with PyTorch's fixed "
                     "segments the allocator reserved 0.2-9.2 GiB above the allocated peak, 28 GiB in an earlier run; "
                     "with expandable_segments:True, which rltt sets in PYTORCH_CUDA_ALLOC_CONF unless the variable "
                     "is set, 0.13-5.3 GiB)")
    for key, value in plan.host.items():
        lines.append(f"{HOST_LABELS[key]:<{width}}{_gib(value)}  host memory of the Ray driver ({value / 2**20:.1f} MiB), "
                     f"not the device's")
    setting = "auto" if plan.chunk_rows_setting == "auto" else f"rollout.chunk_rows={plan.chunk_rows_setting}"
    line = engine.chunk_line(rows, plan.rows_per_rank, setting, plan.chunks_per_step)
    if line:
        lines.append(line)
    for note in plan.notes:
        lines.append(f"note: {note}")
    if plan.fits:
        lines.append(f"verdict: fits — rollout phase {plan.phases['rollout'] / GIB:.1f} GiB ({chunk}), "
                     f"learner phase {plan.phases['learner'] / GIB:.1f} GiB, of {plan.budget_bytes / GIB:.1f} GiB "
                     f"usable ({plan.device_bytes / GIB:.1f} GiB less {plan.headroom:.0%} headroom)")
    else:
        lines.append(f"verdict: {plan.problem}")
    return "\n".join(lines)
