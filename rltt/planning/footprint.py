"""Per-device bytes of each part of a run, and the two phases' peaks.

P parameters, b = bytes of the trained dtype (`RunSettings.train_bytes`), N = ranks (``--gpus``),
part = ⌈P / N⌉ (a ZeRO partition)::

    weights         b·P                 (ZeRO-3: b·part + b·(largest module + prefetch bucket) gathered)
    reference       b·P when algorithm.kl_coef > 0 or algorithm.track_kl (a frozen full copy, cast to the
                    policy's dtype: `rltt.learner.learner.Learner`)
    engine_copy     b_engine·P when the native engine does not share the learner's model
                    (`rltt.orchestration.components.shares_model`)
    vllm            rollout.engine=vllm, what it holds through the learner phase: its share —
                    gpu_memory_utilization × device memory (GPU), kv_cache_gb + b_engine·P (CPU) —
                    or, asleep (rollout.vllm.sleep, on with CUDA), what sleep level 1 keeps
                    (`rltt.planning.engine_memory.VLLM_ASLEEP`)
    vllm_woken      rollout phase only: the rest of its share, mapped back for each rollout (weights, KV)
                    (both from the engine's row of `rltt.planning.engine_memory.ENGINE_MEMORY`)
    optimizer       AdamW's two moments: torch 2·b·P (in the parameters' dtype); DeepSpeed 8·P (ZeRO 0),
                    8·part (ZeRO ≥ 1)
    master_weights  DeepSpeed only: fp32 copy 4·P (ZeRO 0 with bf16), 4·part (ZeRO ≥ 1); torch keeps none
    gradients       torch b·P; DeepSpeed ZeRO 0/1 b·P; ZeRO 2/3 b·part + b·min(reduce bucket 5e8, P)
    loop_gradients  b·(L·P_layer + d·[final norm]) when T > 1: every shared-block parameter is used by
                    each loop step, and autograd sums its T contributions in a buffer of its size from
                    the backward of loop T to that of loop 1, beside the gradients already accumulated
    step_workspace  at the optimizer step (activations are freed by then): DeepSpeed's fp32 gradients
                    (4·P ZeRO 0 with bf16, 4·part ZeRO ≥ 1) + AdamW's foreach temporaries (one moment
                    of the local parameters on CUDA; two copies of the largest tensor on CPU)
    runtime         CUDA context and library workspaces (1 GiB) or the CPU process (0.5 GiB)

Every other figure is allocated bytes (what ``torch.cuda.memory_allocated`` counts). What the
caching allocator reserves beyond them (fragmentation, cached free blocks) and untracked library
buffers are not modelled: the plan leaves ``train.memory_headroom`` of each device free for them
(`RunSettings.budget_bytes`), and a phase fits when it is at most the rest.

Activations and the log-prob workspace: `rltt.planning.activations`; rollout KV, state and
workspace: `rltt.planning.rollout_memory`. Phases::

    rollout = resident + rollout_kv + rollout_state + rollout_workspace + vllm_woken
    learner = resident + gradients + max(activations + logits_workspace,          (the LM head's backward)
                                         held + loop_gradients,                    (loop T's backward done)
                                         step_workspace)                           (the optimizer step)
    resident = runtime + weights + reference + engine_copy + vllm + optimizer + master_weights

(held: the activations still held after loop T's backward, `rltt.planning.activations.held_after_last_loop`.)

(the native engine frees its chunk's buffers before the learner runs; gradients are dropped after
each optimizer step). The vLLM engine's KV lives inside its share, so its native rollout terms
are 0.
"""

from __future__ import annotations

from rltt.planning import activations as act
from rltt.planning.engine_memory import GIB, ROLLOUT, engine_memory
from rltt.planning.run_settings import RunSettings
from rltt.planning.shapes import ModelShape

RUNTIME = {"cuda": GIB, "cpu": GIB // 2}  # the CUDA context and library workspaces, or the CPU process
DS_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size (elements)
DS_PREFETCH_BUCKET = 50_000_000  # DeepSpeed's default stage3_prefetch_bucket_size (elements)

RESIDENT = ("runtime", "weights", "reference", "engine_copy", "vllm", "optimizer", "master_weights")
LEARNER = ("gradients", "loop_gradients", "activations", "logits_workspace", "step_workspace")
ORDER = RESIDENT + ROLLOUT + LEARNER


def resident(shape: ModelShape, s: RunSettings, device_bytes: int) -> dict[str, int]:
    P, b = shape.parameters, s.train_bytes
    part = -(-P // s.gpus)
    ds = s.backend == "deepspeed"
    weights = b * P
    if ds and s.zero_stage == 3:
        weights = b * part + b * (shape.largest_module_parameters + min(DS_PREFETCH_BUCKET, P))
    if not ds:
        optimizer, master = 2 * b * P, 0
    elif s.zero_stage == 0:
        optimizer, master = 8 * P, 4 * P * (s.train_bytes == 2)
    else:
        optimizer, master = 8 * part, 4 * part
    engine = engine_memory(s.engine).resident(shape, s, device_bytes)
    return {
        "runtime": RUNTIME[s.device],
        "weights": weights,
        "reference": b * P if s.needs_reference else 0,
        "engine_copy": engine["engine_copy"],
        "vllm": engine["vllm"],
        "optimizer": optimizer,
        "master_weights": master,
    }


def learner(shape: ModelShape, s: RunSettings) -> dict[str, int]:
    P, b = shape.parameters, s.train_bytes
    part = -(-P // s.gpus)
    ds = s.backend == "deepspeed"
    local = part if ds and s.zero_stage >= 1 else P
    if ds and s.zero_stage >= 2:
        gradients = b * part + b * min(DS_REDUCE_BUCKET, P)
    else:
        gradients = b * P
    fp32_grads = 0
    if ds:  # a 16-bit model accumulates in fp32 (rltt.learner.backends.deepspeed_config): ZeRO-1's BF16
        # optimizer in a full-size fp32 buffer on every rank, ZeRO-2/3 in fp32 gradient partitions
        fp32_grads = 4 * P if s.zero_stage == 1 and b == 2 else 4 * part if s.zero_stage >= 1 else 4 * P * (b == 2)
    moment_bytes = 4 if ds else b
    foreach = moment_bytes * local if s.device == "cuda" else 2 * moment_bytes * shape.largest_module_parameters
    positions, scored, keys = s.learner_positions()  # packed or padded (RunSettings.learner_positions)
    impl = "triton" if s.device == "cuda" else "chunked"
    shared = shape.layers * shape.layer_parameters() + shape.hidden * shape.final_norm
    return {
        "gradients": gradients,
        "loop_gradients": b * shared if shape.loops > 1 else 0,
        "activations": act.activation_bytes(shape, b, positions, scored, s.checkpointing, key_positions=keys,
                                            fp32_readout=s.fp32_head),
        "logits_workspace": act.logits_workspace_bytes(shape, b, b, positions, scored, impl),
        "step_workspace": fp32_grads + foreach,
    }


def rollout(shape: ModelShape, s: RunSettings, rows: int, device_bytes: int) -> dict[str, int]:
    """The rollout terms of a chunk of ``rows`` rows (the engine's row of the table)."""
    return engine_memory(s.engine).rollout(shape, s, rows, device_bytes)


def held_activations(shape: ModelShape, s: RunSettings) -> int:
    """The activations still held when the backward has gone through the last loop step."""
    positions, scored, keys = s.learner_positions()
    return act.held_after_last_loop(shape, s.train_bytes, positions, scored, s.checkpointing, key_positions=keys,
                                    fp32_readout=s.fp32_head)


def phases(components: dict[str, int], held: int | None = None) -> dict[str, int]:
    """The rollout and learner phases' peak bytes from a full components map; ``held``: the
    activations held after the last loop's backward (`held_activations`; None: all of them)."""
    c = components
    held = c["activations"] if held is None else held
    base = sum(c[k] for k in RESIDENT)
    return {
        "rollout": base + sum(c[k] for k in ROLLOUT),
        "learner": base + c["gradients"] + max(c["activations"] + c["logits_workspace"], held + c["loop_gradients"],
                                               c["step_workspace"]),
    }
