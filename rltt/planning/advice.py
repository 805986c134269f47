"""The verdict line of a plan that does not fit: one line naming the recipe keys to change.

It re-plans single changes of the settings and names up to three that fit, with the failing
phases' new peaks. First the changes that keep what the run computes, in this order:
``learner.activation_checkpointing=true``, the largest ``learner.micro_batch_size`` that fits (then
with checkpointing), a higher ``learner.zero_stage`` (more than one rank), a smaller
``rollout.vllm.gpu_memory_utilization``; only when none fits, ``algorithm.track_kl=false`` (drops
the frozen reference when ``kl_coef`` is 0) and a shorter ``rollout.max_new_tokens``. With
``rollout.chunk_rows: N`` too large for the rollout phase it names the largest N that fits.
"""

from __future__ import annotations

from dataclasses import replace

from rltt.planning.engine_memory import engine_memory
from rltt.planning.footprint import GIB
from rltt.planning.run_settings import KEYS, RunSettings
from rltt.planning.shapes import ModelShape

MAX_NAMED = 3


def gib(n: int | float) -> str:
    return f"{n / GIB:.1f}"


def _assign(changes: dict) -> str:
    parts = []
    for name, value in changes.items():
        if name == "needs_reference":  # the reference is kept for track_kl at kl_coef 0
            value = False
        parts.append(f"{KEYS[name]}={str(value).lower() if isinstance(value, bool) else value}")
    return " ".join(parts)


def _memory_changes(s: RunSettings):
    """Changes that keep what the run computes: checkpointing, micro-batch, ZeRO stage, vLLM share."""
    if not s.checkpointing:
        yield {"checkpointing": True}
    for with_ckpt in ((False, True) if not s.checkpointing else (False,)):
        for mb in range(s.micro_rows - 1, 0, -1):
            yield ({"checkpointing": True} if with_ckpt else {}) | {"micro_batch_size": mb}
    if s.gpus > 1:
        for stage in range(s.zero_stage + 1, 4):
            yield ({"backend": "deepspeed"} if s.backend == "torch" else {}) | {"zero_stage": stage}
    yield from engine_memory(s.engine).memory_changes(s)


def _task_changes(s: RunSettings):
    """Changes to what the run computes or logs, tried when no memory change fits."""
    if s.needs_reference and s.kl_coef == 0:
        yield {"needs_reference": False}
    width = s.completion_tokens
    while width > 16:
        width //= 2
        yield {"completion_tokens": width}


def problem_line(shape: ModelShape, s: RunSettings, device_bytes: int, plan, plan_settings) -> str:
    """One line: what does not fit and the recipe keys that would make it fit; ``plan_settings``
    re-plans a changed setting (`rltt.planning.memory_plan.plan_settings`)."""
    budget = plan.budget_bytes
    failing = [name for name, value in plan.phases.items() if value > budget or
               (name == "rollout" and plan.rollout_rows_per_chunk == 0)]
    head = (f"does not fit in {gib(device_bytes)} GiB per device ({gib(budget)} GiB usable: {KEYS['headroom']}="
            f"{s.headroom:g} is left free): " + _what_fails(s, budget, plan))
    if s.chunk_rows != "auto" and plan.phases["learner"] <= budget:
        auto = plan_settings(shape, replace(s, chunk_rows="auto"), device_bytes)
        if auto.fits:
            return f"{head}; set rollout.chunk_rows={auto.rollout_rows_per_chunk} or auto"
    named: list[str] = []
    for tier in (_memory_changes, _task_changes):
        seen_keys: list[frozenset] = []
        for changes in tier(s):
            keys = frozenset(changes) - {"backend"}
            if any(done <= keys for done in seen_keys):  # the largest fitting value, the fewest keys
                continue
            trial = plan_settings(shape, replace(s, **changes), device_bytes)
            extra = ""
            if not trial.fits and s.chunk_rows != "auto":
                trial = plan_settings(shape, replace(s, **changes, chunk_rows="auto"), device_bytes)
                extra = f" rollout.chunk_rows={trial.rollout_rows_per_chunk}"
            if trial.fits:
                seen_keys.append(keys)
                shown = ", ".join(f"{name} phase {gib(trial.phases[name])} GiB" for name in failing)
                named.append(f"{_assign(changes)}{extra} ({shown})")
                if len(named) == MAX_NAMED:
                    break
        if named:
            return f"{head}; set " + ", or ".join(named)
    return (f"{head}; no single change of learner.activation_checkpointing, learner.micro_batch_size, "
            f"learner.zero_stage, algorithm.track_kl or rollout.max_new_tokens makes it fit: use a device with more "
            f"memory, more GPUs (--gpus with learner.zero_stage=3) or a smaller model")


def _what_fails(s: RunSettings, budget: int, plan) -> str:
    parts = []
    if plan.rollout_rows_per_chunk == 0:
        parts.append(f"the rollout phase needs {gib(plan.phases['rollout'])} GiB even at one group "
                     f"({min(s.group_size, s.rows_per_rank)} rows) per chunk")
    elif plan.phases["rollout"] > budget:
        parts.append(f"the rollout phase needs {gib(plan.phases['rollout'])} GiB at rollout.chunk_rows="
                     f"{plan.rollout_rows_per_chunk}")
    if plan.phases["learner"] > budget:
        parts.append(f"the learner phase needs {gib(plan.phases['learner'])} GiB "
                     f"(activations {gib(plan.components['activations'])} GiB for {s.micro_rows} rows × "
                     f"{s.sequence_tokens} tokens)")
    return " and ".join(parts)
