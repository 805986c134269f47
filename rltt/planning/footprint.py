"""Per-device bytes of each part of a run, and the two phases' peaks.

P parameters, b = bytes of the trained dtype (`RunSettings.train_bytes`), N = ranks (``--gpus``),
part = ⌈P / N⌉ (a ZeRO partition), B = min(5·10⁸, P) elements: the reduce bucket rltt asks DeepSpeed for
(`rltt.learner.backends.bucket_elements`; DeepSpeed's default 5·10⁸ would be allocated whole for any
model). DeepSpeed terms as 0.19.8 allocates them, measured at ZeRO 1-3 on CPU
(tests/planning/test_deepspeed_peak.py)::

    weights         b·P                 (ZeRO-3: b·part + b·(largest module + prefetch bucket) gathered)
    reference       b·P when algorithm.kl_coef > 0 or algorithm.track_kl (a frozen full copy, cast to the
                    policy's dtype: `rltt.learner.learner.Learner`)
    engine_copy     b_engine·P when the native engine does not share the learner's model
                    (`rltt.orchestration.components.shares_model`)
    engine_fused    native engine: b_engine·L·(q + 2·kv)·(d + [attention_bias]), the concatenated q/k/v
                    weights its model keeps for decoding (`rltt.model.layers.FusedWeights`), shared model
                    or not; 0 with a step-wise LoRA on q, k or v
    engine_graphs   native engine with rollout.cuda_graphs (null: on with CUDA): every bucket's static buffers
                    and the CUDA graphs' shared pool (`rltt.planning.graph_memory`); 0 without
    vllm            rollout.engine=vllm, what it holds through the learner phase: its share —
                    gpu_memory_utilization × device memory (GPU), kv_cache_gb + b_engine·P (CPU) —
                    or, asleep (rollout.vllm.sleep, on with CUDA), what sleep level 1 keeps
                    (`rltt.planning.engine_memory.VLLM_ASLEEP`)
    vllm_woken      rollout phase only: the rest of its share, mapped back for each rollout (weights, KV)
                    (both from the engine's row of `rltt.planning.engine_memory.ENGINE_MEMORY`)
    optimizer       AdamW's two moments: torch 8·P (fp32; on the fp32 masters of a 16-bit module);
                    DeepSpeed 8·P (ZeRO 0), 8·part (ZeRO ≥ 1)
    master_weights  fp32 copy: torch 4·P with a 16-bit module (none in fp32); DeepSpeed 4·P (ZeRO 0 with
                    bf16), 4·part (ZeRO ≥ 1)
    grad_buffers    DeepSpeed with a 16-bit model (fp32 accumulation), allocated at start-up and held
                    through both phases: ZeRO-1 4·P (BF16_Optimizer's fp32 sum, full size on every rank);
                    ZeRO-3 b·B + 4·part (its reduce bucket and fp32 gradient partitions); else 0
    gradients       fp32 torch and DeepSpeed ZeRO 0: b·P. 16-bit torch: 4·P (the masters' fp32 sums, from
                    the first micro-batch's backward to the step) + b·(largest module) (one 16-bit
                    ``.grad``, freed by its hook once added in). 16-bit DeepSpeed: ZeRO-1 b·P (the bf16 .grad tensors,
                    until the step); ZeRO-2 4·part (the fp32 partition, from the first reduction to the
                    step, where it is the optimizer's gradient); ZeRO-3 0 (resident). fp32 DeepSpeed
                    ZeRO 2/3: b·part + b·B
    reduce_bucket   16-bit ZeRO-2: b·B, from each backward's first gradient hook to its end (counted with
                    the two backward peaks, not at the step); ZeRO-3's reduce-scatter temporaries in
                    the backward (up to (b + 4)·B) are not modelled: unmeasured as a peak
    loop_gradients  b·(L·P_layer + d·[final norm]) when T > 1: every shared-block parameter is used by
                    each loop step, and autograd sums its T contributions in a buffer of its size from
                    the backward of loop T to that of loop 1, beside the gradients already accumulated
    LoRA (``learner.lora``): the adapters are part of the weights (P counts them), no reference copy (the
                    reference is the policy with its adapters off), and optimizer, master_weights,
                    grad_buffers, gradients, loop_gradients and step_workspace take the adapters' parameter
                    count A in place of P (largest module: the largest adapter tensor); activations count
                    the adapters' rank-r intermediates (`rltt.planning.activations`) and keep the frozen
                    layers' saved inputs (an upper bound: a frozen weight needs none for its own gradient)
    step_workspace  at the optimizer step (activations are freed by then): AdamW's temporaries (CUDA:
                    foreach, one fp32 moment of the local parameters; CPU: two fp32 copies of the largest
                    tensor it is handed — DeepSpeed ZeRO ≥ 1 hands it one flat fp32 partition, 8·part) +
                    16-bit ZeRO-3's flattened fp32 copy of its gradient partitions (4·part) or fp32
                    ZeRO ≥ 1's fp32 gradient partition (4·part)
    runtime         CUDA context, NCCL and cuBLAS workspaces (1.3 GiB: measured on an H200, `RUNTIME`) or the
                    CPU process (0.5 GiB)

Every other figure is allocated bytes (what ``torch.cuda.memory_allocated`` counts), in the steady
state: AdamW creates its moments (``optimizer``) at its first step, so the first rollout and the
first update's backward hold 8·part less than planned (on the H200 run of 2026-12-04 the plan less
those moments was within 0.5 % of the allocated peaks of both). What the caching allocator reserves
beyond allocated bytes (fragmentation, cached free blocks) and untracked library buffers are not
modelled: the plan leaves ``train.memory_headroom`` of each device free for them
(`RunSettings.budget_bytes`), and a phase fits when it is at most the rest. That share is not
always enough with PyTorch's fixed-size segments: on the same run the learner at micro-batch 4
reserved 28 GiB above its allocated peak (11 GiB at micro-batch 16 with checkpointing), more than
the 0.1 headroom of an 80 GB card; rltt turns on expandable segments for that
(`rltt.runtime.allocator`): in a second run 0.13-5.3 GiB reserved above the allocated peaks with them,
0.2-9.2 GiB without.

Activations and the log-prob workspace: `rltt.planning.activations`; rollout KV, state and
workspace: `rltt.planning.rollout_memory`. Phases::

    rollout = resident + rollout_kv + rollout_state + rollout_workspace + vllm_woken
    learner = resident + gradients + max(activations + logits_workspace + reduce_bucket,  (the LM head's backward)
                                         held + loop_gradients + reduce_bucket,            (loop T's backward done)
                                         step_workspace)                                   (the optimizer step)
    resident = runtime + weights + reference + engine_copy + engine_fused + engine_graphs + vllm + optimizer + master_weights
               + grad_buffers

(held: the activations still held after loop T's backward, `rltt.planning.activations.held_after_last_loop`.)

(the native engine frees its chunk's buffers before the learner runs; gradients are dropped after
each optimizer step). The vLLM engine's KV lives inside its share, so its native rollout terms
are 0.
"""

from __future__ import annotations

from rltt.learner.backends import bucket_elements
from rltt.planning import activations as act
from rltt.planning.engine_memory import GIB, ROLLOUT, engine_memory
from rltt.planning.run_settings import RunSettings
from rltt.planning.shapes import ModelShape

#: what a process holds outside the allocator: on CUDA the context, NCCL and cuBLAS workspaces — measured
#: 1.293 GiB on an H200 with torch 2.11 + CUDA 13 and an NCCL group (bench/gpu_check_deepspeed.py, card80,
#: 2026-12-04), other GPUs and CUDA versions not measured; on the CPU the process itself (0.5 GiB)
RUNTIME = {"cuda": int(1.3 * GIB), "cpu": GIB // 2}
DS_PREFETCH_BUCKET = 50_000_000  # DeepSpeed's default stage3_prefetch_bucket_size (elements)

RESIDENT = ("runtime", "weights", "reference", "engine_copy", "engine_fused", "engine_graphs", "vllm", "optimizer", "master_weights",
            "grad_buffers")
LEARNER = ("gradients", "reduce_bucket", "loop_gradients", "activations", "logits_workspace", "step_workspace")
ORDER = RESIDENT + ROLLOUT + LEARNER


def trained_parameters(shape: ModelShape, s: RunSettings) -> int:
    """The parameters the optimizer trains: every one, or with ``learner.lora`` the adapters alone
    (``shape`` then holds them: `rltt.planning.memory_plan.plan_settings`)."""
    return shape.adapter_parameters if s.lora else shape.parameters


def largest_trained(shape: ModelShape, s: RunSettings) -> int:
    """The largest trained tensor (a 16-bit ``.grad`` before its hook frees it; CPU AdamW's temporaries)."""
    return shape.largest_adapter_parameters if s.lora else shape.largest_module_parameters


def resident(shape: ModelShape, s: RunSettings, device_bytes: int) -> dict[str, int]:
    b = s.train_bytes
    P = trained_parameters(shape, s)  # the optimizer's, master weights' and gradients' parameters
    part = -(-P // s.gpus)
    ds = s.backend == "deepspeed"
    weights = b * shape.parameters
    if ds and s.zero_stage == 3:
        every = shape.parameters
        weights = b * -(-every // s.gpus) + b * (shape.largest_module_parameters + min(DS_PREFETCH_BUCKET, every))
    if not ds:  # torch: AdamW on the fp32 parameters, or on the fp32 masters of a 16-bit module
        optimizer, master = 8 * P, 4 * P * _mixed_torch(s)
    elif s.zero_stage == 0:
        optimizer, master = 8 * P, 4 * P * (s.train_bytes == 2)
    else:
        optimizer, master = 8 * part, 4 * part
    grad_buffers = 0  # allocated when DeepSpeed starts and held through both phases (fp32 accumulation)
    if _bf16_deepspeed(s) and s.zero_stage == 1:  # BF16_Optimizer's fp32 sum, full size on every rank
        grad_buffers = 4 * P
    elif _bf16_deepspeed(s) and s.zero_stage == 3:  # the bf16 reduce bucket and the fp32 gradient partitions
        grad_buffers = b * bucket_elements(P) + 4 * part
    engine = engine_memory(s.engine).resident(shape, s, device_bytes)
    return {
        "runtime": RUNTIME[s.device],
        "weights": weights,
        "reference": b * shape.parameters if s.needs_reference and not s.lora else 0,  # LoRA: adapters off
        "engine_copy": engine["engine_copy"],
        "engine_fused": engine["engine_fused"],
        "engine_graphs": engine["engine_graphs"],
        "vllm": engine["vllm"],
        "optimizer": optimizer,
        "master_weights": master,
        "grad_buffers": grad_buffers,
    }


def _mixed_torch(s: RunSettings) -> bool:
    """The torch backend on a 16-bit module: fp32 masters and fp32 gradient sums
    (`rltt.learner.backends.TorchBackend`)."""
    return s.backend == "torch" and s.train_bytes == 2


def _bf16_deepspeed(s: RunSettings) -> bool:
    """DeepSpeed with a 16-bit model: fp32 gradient accumulation (`rltt.learner.backends.deepspeed_config`)."""
    return s.backend == "deepspeed" and s.train_bytes == 2


def learner(shape: ModelShape, s: RunSettings) -> dict[str, int]:
    P, b = trained_parameters(shape, s), s.train_bytes
    part = -(-P // s.gpus)
    ds = s.backend == "deepspeed"
    local = part if ds and s.zero_stage >= 1 else P
    bucket = b * bucket_elements(P)  # rltt asks for min(DeepSpeed's default, P) elements
    reduce_bucket, step_grads = 0, 0
    if _bf16_deepspeed(s) and s.zero_stage == 1:  # BF16_Optimizer: bf16 .grad until the step (its fp32 sum: resident)
        gradients = b * P
    elif _bf16_deepspeed(s) and s.zero_stage == 2:  # the fp32 partition, the optimizer's own gradient at the step
        gradients, reduce_bucket = 4 * part, bucket  # the bf16 bucket: from each backward's first hook to its end
    elif _bf16_deepspeed(s) and s.zero_stage == 3:  # bucket and fp32 partitions are resident; the step
        gradients, step_grads = 0, 4 * part  # flattens the partitions into a second fp32 copy
    elif ds and s.zero_stage >= 2:  # an fp32 model (not re-measured)
        gradients = b * part + bucket
    elif _mixed_torch(s):  # the masters' fp32 sums, plus one 16-bit .grad while a hook adds it in
        gradients = 4 * P + b * largest_trained(shape, s)
    else:
        gradients = b * P
    if ds and b == 4 and s.zero_stage >= 1:  # an fp32 model: DeepSpeed's fp32 gradient partition at the step
        step_grads = 4 * part
    if s.device == "cuda":  # AdamW's foreach temporaries: one moment of the local parameters
        foreach = 4 * local
    elif ds and s.zero_stage >= 1:  # CPU: single-tensor AdamW on DeepSpeed's flat fp32 partition
        foreach = 2 * 4 * part
    else:  # CPU: two copies of the largest tensor
        foreach = 2 * 4 * largest_trained(shape, s)
    positions, scored, keys = s.learner_positions()  # packed or padded (RunSettings.learner_positions)
    impl = "triton" if s.device == "cuda" else "chunked"
    shared = shape.layers * shape.layer_parameters() + shape.hidden * shape.final_norm
    if s.lora:  # only the adapters have gradients to sum over the loop steps
        shared = shape.adapter_parameters
    return {
        "gradients": gradients,
        "reduce_bucket": reduce_bucket,
        "loop_gradients": b * shared if shape.loops > 1 else 0,
        "activations": act.activation_bytes(shape, b, positions, scored, s.checkpointing, key_positions=keys,
                                            fp32_readout=s.fp32_head, fused_norm=s.device == "cuda"),
        "logits_workspace": act.logits_workspace_bytes(shape, b, b, positions, scored, impl,
                                                       kept_bytes=s.engine_bytes if s.truncates else 4),
        "step_workspace": step_grads + foreach,
    }


def rollout(shape: ModelShape, s: RunSettings, rows: int, device_bytes: int) -> dict[str, int]:
    """The rollout terms of a chunk of ``rows`` rows (the engine's row of the table)."""
    return engine_memory(s.engine).rollout(shape, s, rows, device_bytes)


def held_activations(shape: ModelShape, s: RunSettings) -> int:
    """The activations still held when the backward has gone through the last loop step."""
    positions, scored, keys = s.learner_positions()
    return act.held_after_last_loop(shape, s.train_bytes, positions, scored, s.checkpointing, key_positions=keys,
                                    fp32_readout=s.fp32_head, fused_norm=s.device == "cuda")


def phases(components: dict[str, int], held: int | None = None) -> dict[str, int]:
    """The rollout and learner phases' peak bytes from a full components map; ``held``: the
    activations held after the last loop's backward (`held_activations`; None: all of them)."""
    c = components
    held = c["activations"] if held is None else held
    base = sum(c[k] for k in RESIDENT)
    return {
        "rollout": base + sum(c[k] for k in ROLLOUT),
        "learner": base + c["gradients"] + max(c["activations"] + c["logits_workspace"] + c["reduce_bucket"],
                                               held + c["loop_gradients"] + c["reduce_bucket"], c["step_workspace"]),
    }
