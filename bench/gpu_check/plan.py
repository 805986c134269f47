"""The ``plan`` section: `rltt plan`'s phase peaks against the allocator's, for a train-like step."""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path

from .context import GIB, ROOT, Context, engine_calls, model_setting, ratio
from .report import Deadline, SectionResult

# -- plan: the memory plan against the GPU's allocator ---------------------------------------------------
def _scale_meter():
    """bench/scale.py's CPU meter (live tensors + the profiler's allocation peak), for the CPU smoke."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scale_meter", ROOT / "bench" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def measure_phase(ctx: Context, fn):
    """``(fn(), start bytes, peak bytes)``: on CUDA the allocated bytes at the start and
    ``max_memory_allocated`` over the call (peak stats reset at its start); on CPU bench/scale.py's
    meter (live tensor bytes + the allocator events' running peak)."""
    import torch

    if ctx.cuda:
        ctx.sync()
        start = torch.cuda.memory_allocated(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        out = fn()
        ctx.sync()
        return out, start, torch.cuda.max_memory_allocated(ctx.device)
    out, measured = _scale_meter().measure_call(fn)
    return out, measured.start_bytes, measured.peak


def section_plan(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    """`rltt plan`'s two phase peaks against the measured ones, for a train-like step on the Ouro-shaped
    model: the recipe's engine and learner built by `rltt train`'s factories (torch backend, bf16,
    ``track_kl``: a reference copy; the engine shares the policy), then two steps of rollout →
    learner update (random advantages) → weight sync; the second step is measured (the first
    creates AdamW's moments, which the plan counts as resident). The plan excludes its runtime
    component (CUDA context and library workspaces: not allocated tensors). Without and with
    ``learner.activation_checkpointing``."""
    from dataclasses import replace

    import torch
    import yaml

    from rltt.learner import LearnerBatch
    from rltt.orchestration.components import make_engine, make_learner
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.planning import plan_run
    from rltt.rollout import SamplingParams

    p = ctx.shapes.plan
    model = ctx.ouro_model()
    vocab = model.config.vocab_size
    device_bytes = (torch.cuda.get_device_properties(ctx.device).total_memory if ctx.cuda else 64 * GIB)
    last = 0.0
    with tempfile.TemporaryDirectory(prefix="rltt-gpu-check-plan-") as name, engine_calls(sec):
        tmp = Path(name)
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_text(json.dumps(ctx.shapes.model))
        for ckpt in (False, True):
            tag = f"plan.ckpt_{'on' if ckpt else 'off'}"
            if not deadline.allows(1.3 * last):
                sec.skip(f"{tag}: the step does not fit the time left")
                continue
            start_time = time.perf_counter()
            raw = {
                "model": {"path": str(tmp / "model"), "dtype": "bf16", "device": ctx.device.type},
                "data": {"source": "synthetic:quickstart", "max_prompt_tokens": p["prompt_len"]},
                "rollout": {"prompts_per_step": p["prompts"], "group_size": p["group"],
                            "max_new_tokens": p["new_tokens"], "schedule": "deferred", "exit_policy": "sample"},
                "algorithm": {"track_kl": True},
                "learner": {"backend": "torch", "dtype": "bf16", "lr": 1e-6, "micro_batch_size": p["micro"],
                            "activation_checkpointing": ckpt},
                "logging": {"run_dir": str(tmp / "run")},
            }
            (tmp / "recipe.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
            recipe = load_train_recipe(tmp / "recipe.yaml", [])
            plan = plan_run(recipe, ctx.shapes.model, device_bytes, device="cuda" if ctx.cuda else "cpu")
            # as `rltt train` resolves rollout.chunk_rows: auto from its plan
            recipe = replace(recipe, rollout=replace(recipe.rollout, chunk_rows=plan.rollout_rows_per_chunk))
            meter = ("max_memory_allocated, peak reset per phase" if ctx.cuda
                     else "live tensors + profiler allocation peak, bench/scale.py")
            setting = (f"{model_setting(model)}; {tag.split('.')[1]}: {p['prompts']} prompts x G={p['group']}, random "
                       f"prompts of {p['prompt_len']} tokens + {p['new_tokens']} new (ignore_eos), deferred, sampled "
                       f"exits; torch AdamW bf16, track_kl, micro-batch {p['micro']}, packed; the second of two "
                       f"steps measured ({meter}); plan = rltt plan's phase minus its runtime component")
            engine = learner = None
            try:
                engine = make_engine(recipe, model)
                learner = make_learner(recipe, model)
                gen = torch.Generator().manual_seed(7)
                measured = {}
                for step in (1, 2):
                    prompts = [torch.randint(1, vocab, (p["prompt_len"],), generator=gen).tolist()
                               for _ in range(p["prompts"])]
                    params = SamplingParams(temperature=1.0, max_new_tokens=p["new_tokens"], n=p["group"], seed=step,
                                            schedule="deferred", exit_policy="sample", ignore_eos=True)
                    if step == 2:
                        rollout, *measured["rollout"] = measure_phase(ctx, lambda: engine.generate(prompts, params))
                    else:
                        rollout = engine.generate(prompts, params)
                    batch = LearnerBatch.from_rollout(rollout, advantages=torch.randn(rollout.completion_ids.shape[0],
                                                                                      generator=gen))
                    del rollout
                    if step == 2:
                        metrics, *measured["learner"] = measure_phase(ctx, lambda: learner.update(batch))
                    else:
                        metrics = learner.update(batch)
                    engine.load_weights(*learner.rollout_state_dict())
                runtime = plan.components["runtime"]
                for phase in ("rollout", "learner"):
                    start, peak = measured[phase]
                    planned = plan.phases[phase] - runtime
                    sec.add(f"{tag}.{phase}.planned_gib", round(planned / GIB, 6), "GiB", setting)
                    sec.add(f"{tag}.{phase}.measured_gib", round(peak / GIB, 6), "GiB", setting)
                    sec.add(f"{tag}.{phase}.start_gib", round(start / GIB, 6), "GiB (allocated at the phase start)",
                            setting)
                    sec.add(f"{tag}.{phase}.planned/measured", ratio(planned, peak), "x (target 0.85-1.15)", setting)
                sec.add(f"{tag}.activations_planned_gib", round(plan.components["activations"] / GIB, 6), "GiB",
                        setting)
                sec.add(f"{tag}.rows_per_chunk", plan.rollout_rows_per_chunk, "rows", setting)
                sec.add(f"{tag}.loss_finite", bool(math.isfinite(metrics["loss/total"])), "", setting)
            finally:
                del engine, learner
                model.gradient_checkpointing_disable()
                model.eval()
                ctx.release()
            last = time.perf_counter() - start_time
            sec.add(f"{tag}.seconds", round(last, 2), "s (two steps)", setting)

