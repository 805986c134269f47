"""The DeepSpeed part of bench/gpu_check, in its own process (gpu_check makes DeepSpeed
unimportable for its own process, as on an image without it): the default GPU path,
``rltt train recipes/gsm8k.yaml`` (DeepSpeed ZeRO-2, bf16).

    python bench/gpu_check_deepspeed.py --out DIR --budget SECONDS [--cpu-smoke]

Writes ``DIR/deepspeed.json`` after every sub-step (a run stopped early keeps what it measured):
``{"absent": reason}`` when DeepSpeed is not installed, else ``{"figures": [{name, value, unit,
setting}, ...], "failures": [...], "skipped": [...]}``. Sub-steps, in this order, each skipped
when the time left cannot cover its estimate:

- ``grad``: one bf16 DeepSpeed ZeRO-2 update summing many micro-batches (rltt's learner, its
  DeepSpeed backend as configured): the accumulated gradient DeepSpeed holds at the optimizer step
  (``deepspeed.utils.safe_get_full_grad``, between the last backward and the step) against the
  exact (float64) sum of the same micro-batch gradients, and what a bf16 running sum of them gives,
  for scale (`rltt.learner.accumulation.AccumulationProbe`, the check of tests/learner);
- ``card80``: the recipe on an 80 GB card — on CUDA emulated on the larger GPU with
  ``torch.cuda.set_per_process_memory_fraction`` (the allocator gets 79.2 GiB, the total an 80 GB
  card reports, less what the process holds outside the allocator: CUDA context, NCCL, cuBLAS):
  a random LoopLM of Ouro-1.4B's shape, rltt's engine and DeepSpeed learner as `rltt train` builds
  them, one rollout chunk of `rltt plan`'s rows per chunk at the recipe's lengths (prompts of
  ``data.max_prompt_tokens``, ``rollout.max_new_tokens`` new tokens), one update on 16 of its rows at
  micro-batch 4 without activation checkpointing, the weight sync, then a fresh learner and one
  update at micro-batch 16 with checkpointing. Each learner first makes one unmeasured update (a
  random batch of the same shape) so that AdamW's moments exist, as in every step after the first:
  the plan is of that steady state. Allocated and reserved peaks of each phase against the plan's
  phase (the plan's allocated part: the phase less its ``runtime`` component), the reserved bytes
  above the allocated peak (what the caching allocator holds that the plan does not count) and the
  allocator setting in force. On CUDA each phase runs twice: under the setting rltt's processes get
  (`rltt.runtime.allocator`: expandable segments unless ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise;
  plain figure names), then under the other one (``torch.cuda.memory._set_allocator_settings``,
  names with ``.fixed_segments`` or ``.expandable_segments``), the allocator's cache emptied between;
- ``train``: ``rltt train`` (the CLI, in this process) with ``learner.backend=deepspeed`` (ZeRO-2,
  bf16), ``rollout.chunk_rows=auto`` and activation checkpointing, 2 steps on the GSM8K sample with
  ``checkpoint.every=1``, then ``--resume`` for a third: NCCL start-up, DeepSpeed's save and load,
  the weight sync after each update;
- ``card141``: ``card80`` on the whole GPU (its own plan: more rows per chunk).

The update covers 16 rows, not the step's 512: the phase's peak depends on the micro-batch (its
activations), not on how many micro-batches an update sums. On CPU (``--cpu-smoke``) the same
code runs at the smallest shapes (gloo, DeepSpeed's CPU accelerator); memory is bench/scale.py's
meter (allocated only) and nothing is emulated.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# the cards in GiB (this worker imports rltt only once it knows DeepSpeed is there: it must start,
# and say "absent", where rltt's dependencies are not importable)
CARD_80GB = 79.2  # what torch reports for an 80 GB card (H100/A100 80 GB)

GPU = dict(
    grad=dict(hidden=256, layers=2, heads=4, vocab=512, micro_batches=64, prompt=32, completion=96),
    overrides=[],  # recipes/gsm8k.yaml as it is
    micro=(4, 16), update_rows=16,
    cards=[("card80", CARD_80GB, True), ("card141", None, False)],
    train=dict(hidden=128, layers=2, heads=4, prompts=8, group=8, new_tokens=64, eval_size=16, micro=16,
               dtype="bf16", threads=0),
    estimates=dict(grad=15, card80=90, train=60, card141=120),
)
CPU = dict(
    grad=dict(hidden=32, layers=1, heads=2, vocab=96, micro_batches=8, prompt=4, completion=6),
    overrides=["rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
               "data.max_prompt_tokens=8", "data.eval_size=2"],
    micro=(4, 16), update_rows=8,
    cards=[("card80", CARD_80GB, False), ("card141", 131.3, False)],  # 141 GB: 131.3 GiB
    train=dict(hidden=16, layers=1, heads=2, prompts=1, group=2, new_tokens=4, eval_size=2, micro=2,
               dtype="bf16", threads=1),
    estimates=dict(grad=30, card80=40, train=60, card141=40),
)


def _gc_module():
    sys.path.insert(0, str(Path(__file__).parent))
    import gpu_check  # noqa: E402 - the shared helpers (model, meters, the smoke run's files)

    return gpu_check


class Report:
    def __init__(self, out: Path):
        self.out, self.figures, self.failures, self.skipped = out, [], [], []

    def add(self, name, value, unit="", setting=""):
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        self.figures.append(dict(name=name, value=value, unit=unit, setting=setting))

    def write(self):
        (self.out / "deepspeed.json").write_text(json.dumps(
            dict(figures=self.figures, failures=self.failures, skipped=self.skipped), indent=1, default=str))

    @contextmanager
    def step(self, what: str):
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - recorded; the next sub-step still runs
            self.failures.append(f"{what}: {type(exc).__name__}: {exc}".strip()[:1500])
            print(f"[gpu_check deepspeed] {what} FAILED\n{traceback.format_exc()}", flush=True)
        finally:
            self.write()


def release(ctx) -> None:
    gc.collect()
    if ctx.cuda:
        import torch

        torch.cuda.empty_cache()


def close_learner(learner) -> None:
    """Free a DeepSpeed learner's engine (its hooks, fp32 partitions and optimizer state)."""
    engine = getattr(getattr(learner, "backend", None), "engine", None)
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()


# -- grad: fp32 accumulation of a bf16 update -----------------------------------------------------------
def random_batch(vocab: int, rows: int, prompt: int, completion: int, num_loops: int, seed: int = 3):
    import torch

    from rltt.learner import LearnerBatch

    gen = torch.Generator().manual_seed(seed)
    width = prompt + completion
    ids = torch.randint(1, vocab, (rows, width), generator=gen)
    attn = torch.ones(rows, width, dtype=torch.long)
    target = torch.zeros(rows, width, dtype=torch.bool)
    target[:, prompt:] = True
    exits = torch.where(target, torch.randint(1, num_loops + 1, (rows, width), generator=gen), 1)
    sampler = torch.where(target, -torch.rand(rows, width, generator=gen) * 5 - 1, torch.zeros(rows, width))
    return LearnerBatch(input_ids=ids, attention_mask=attn, target_mask=target, exit_steps=exits,
                        advantages=torch.randn(rows, generator=gen), sampler_logprobs=sampler, temperature=1.0)


def grad_accumulation(ctx, rep: Report, p: dict) -> None:
    import torch

    from rltt.learner import AlgorithmConfig, Learner, LearnerConfig
    from rltt.learner.accumulation import AccumulationProbe
    from rltt.model import LoopConfig, LoopedForCausalLM

    torch.manual_seed(0)
    config = LoopConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=2 * p["hidden"],
                        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_loops=4,
                        max_position_embeddings=max(128, p["prompt"] + p["completion"]))
    with torch.device(ctx.device):
        model = LoopedForCausalLM(config)
    model = model.to(torch.bfloat16)
    k = p["micro_batches"]
    cfg = LearnerConfig(backend="deepspeed", zero_stage=2, dtype="bf16", lr=1e-6, micro_batch_size=1)
    learner = Learner(model, cfg, AlgorithmConfig(track_kl=False), batch_size=k, max_len=p["completion"])
    batch = random_batch(p["vocab"], k, p["prompt"], p["completion"], config.num_loops)
    seconds = time.perf_counter()
    with AccumulationProbe(learner.backend) as probe:  # hooks + the gradient held at the step
        metrics = learner.update(batch)
    seconds = time.perf_counter() - seconds
    check = probe.result
    setting = (f"{ctx.device.type}: LoopLM d={p['hidden']}, L={p['layers']}, T=4, V={p['vocab']}, bf16; rltt's "
               f"DeepSpeed backend as configured, ZeRO-2, one learner update of {k} micro-batches of 1 row "
               f"({p['prompt']} + {p['completion']} tokens); the gradient DeepSpeed holds at the step "
               f"(safe_get_full_grad) against the exact (float64) sum of the micro-batch gradients, and a bf16 "
               f"running sum of the same gradients for scale (rltt.learner.accumulation.AccumulationProbe); "
               f"error: over all parameters as one vector; max_rel_err: the worst tensor's max |diff| / max |exact|")
    if check is None:
        raise RuntimeError("the update reached no optimizer step (nothing to compare)")
    rep.add("grad.micro_batches", check.micro_steps, "micro-batches", setting)
    rep.add("grad.tensors_compared", check.tensors, "tensors", setting)
    rep.add("grad.micro_batch_grad_dtype", check.grad_dtype, "", setting)
    rep.add("grad.accumulated_dtype", check.held_dtype, "(what DeepSpeed holds the sum in)", setting)
    rep.add("grad.error", check.error, "‖held − exact‖ / ‖exact‖", setting)
    rep.add("grad.max_rel_err", check.max_rel_error, "of max |grad|", setting)
    rep.add("grad.bf16_running_sum_error", check.running_sum_error, "‖bf16 sum − exact‖ / ‖exact‖", setting)
    rep.add("grad.bf16_running_sum_max_rel_err", check.running_sum_max_rel_error, "of max |grad|", setting)
    rep.add("grad.within_one_bf16_rounding", check.ok, f"(error <= {check.bound:g})", setting)
    rep.add("grad.update_s", round(seconds, 3), "s", setting)
    rep.add("grad.loss_finite", bool(math.isfinite(metrics["loss/total"])), "", setting)
    if check.micro_steps != k:
        raise RuntimeError(f"the probe saw {check.micro_steps} micro-batches, expected {k}")
    close_learner(learner)


# -- card80 / card141: the recipe's memory phases against the plan ------------------------------------------
#: the allocator's segments -> the PYTORCH_CUDA_ALLOC_CONF option and the figure names' suffix when it
#: is not the setting in force
SEGMENTS = {True: ("expandable_segments:True", "expandable_segments"),
            False: ("expandable_segments:False", "fixed_segments")}


def allocator_modes(ctx) -> list[tuple[str, str, bool | None]]:
    """``(name suffix, setting, expandable)`` for each run of a phase: on CUDA the setting in force
    (suffix "") then the other segments; on the CPU one run, no allocator."""
    if not ctx.cuda:
        return [("", "none (CPU)", None)]
    from rltt.runtime.allocator import ENV, expandable

    on = expandable(os.environ.get(ENV))
    return [("", os.environ.get(ENV) or "PyTorch's default", on), ("." + SEGMENTS[not on][1], SEGMENTS[not on][0], not on)]


def use_segments(ctx, expandable: bool | None) -> None:
    """Empty the allocator's cache, then make new segments expandable or fixed."""
    release(ctx)
    if expandable is not None:
        import torch

        torch.cuda.memory._set_allocator_settings(SEGMENTS[expandable][0])


def optimizer_state_bytes(learner) -> int:
    """Bytes of the tensors in the learner's optimizer state (AdamW's moments: none before its first step)."""
    import torch

    backend = getattr(learner, "backend", None)
    seen, total = set(), 0
    for opt in (getattr(backend, "optimizer", None), getattr(getattr(backend, "optimizer", None), "optimizer", None)):
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        for state in opt.state.values():
            for t in state.values():
                if torch.is_tensor(t) and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


def warm_batch(vocab: int, rows: int, group: int, prompt: int, completion: int, num_loops: int):
    """A random batch shaped like a rollout's: groups of ``group`` rows share their prompt."""
    import torch

    batch = random_batch(vocab, rows, prompt, completion, num_loops, seed=11)
    first = (torch.arange(rows) // group) * group
    batch.input_ids[:, :prompt] = batch.input_ids[first, :prompt]
    return batch


def phase(ctx, fn):
    """``(fn(), start allocated, allocated peak, reserved peak)`` (reserved: None on CPU)."""
    import torch

    if not ctx.cuda:
        out, start, peak = _gc_module().measure_phase(ctx, fn)
        return out, start, peak, None
    ctx.sync()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    ctx.sync()
    return out, start, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def card(ctx, rep: Report, shapes: dict, tag: str, card_gib: float | None, emulate: bool) -> None:
    import torch

    from rltt.data import GSM8K_SAMPLE_DIR
    from rltt.learner import Learner, LearnerBatch
    from rltt.orchestration.components import engine_dtype, make_engine
    from rltt.orchestration.train_recipe import load_train_recipe
    from rltt.planning import plan_run
    from rltt.rollout import SamplingParams
    from rltt.telemetry.schema import GIB

    gcm = _gc_module()
    model_config = ctx.shapes.model
    card_bytes = None if card_gib is None else int(card_gib * GIB)
    if card_bytes is None:
        card_bytes = torch.cuda.get_device_properties(0).total_memory if ctx.cuda else 64 * GIB
    tmp = Path(tempfile.mkdtemp(prefix="rltt-gpu-check-ds-"))
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps(model_config))
    base = [f"model.path={tmp / 'model'}", f"model.device={ctx.device.type}", f"data.source={GSM8K_SAMPLE_DIR}",
            f"logging.run_dir={tmp / 'run'}", *shapes["overrides"]]
    mb_a, mb_b = shapes["micro"]
    recipe_a = load_train_recipe(ROOT / "recipes" / "gsm8k.yaml",
                                 base + [f"learner.micro_batch_size={mb_a}", "learner.activation_checkpointing=false"])
    recipe_b = load_train_recipe(ROOT / "recipes" / "gsm8k.yaml",
                                 base + [f"learner.micro_batch_size={mb_b}", "learner.activation_checkpointing=true"])
    plan_a = plan_run(recipe_a, model_config, card_bytes, device=ctx.device.type)
    plan_b = plan_run(recipe_b, model_config, card_bytes, device=ctx.device.type)
    rows, group = plan_a.rollout_rows_per_chunk, recipe_a.rollout.group_size
    r, lrn = recipe_a.rollout, recipe_a.learner
    setting = (f"{ctx.device.type}, {card_bytes / GIB:.1f} GiB card{' (emulated)' if emulate else ''}: recipes/gsm8k.yaml"
               f"{' ' + ' '.join(shapes['overrides']) if shapes['overrides'] else ''}, random LoopLM of Ouro-1.4B's "
               f"shape (d={model_config['hidden_size']}, L={model_config['num_hidden_layers']}, "
               f"V={model_config['vocab_size']}), DeepSpeed ZeRO-{lrn.zero_stage} {lrn.dtype}, native engine copy; "
               f"one rollout chunk of {rows} rows ({rows // max(group, 1)} prompts x G={group}, prompts of "
               f"{recipe_a.data.max_prompt_tokens} tokens + {r.max_new_tokens} new, ignore_eos); updates on "
               f"{shapes['update_rows']} rows: micro-batch {mb_a} without / {mb_b} with activation checkpointing; "
               f"planned = rltt plan's phase (allocated part: less its runtime component); each learner made one "
               f"unmeasured update first (AdamW's moments held: the plan's steady state)"
               f"{'; each phase under the allocator setting in force, then the other segments' if ctx.cuda else ''}")
    rep.add(f"{tag}.card_gib", round(card_bytes / GIB, 3), "GiB", setting)
    rep.add(f"{tag}.rows_per_chunk", rows, "rows", setting)
    rep.add(f"{tag}.plan_fits", bool(plan_a.fits and plan_b.fits), "", setting)
    if getattr(plan_a, "budget_bytes", None) is not None:  # the device less train.memory_headroom
        rep.add(f"{tag}.plan_budget_gib", round(plan_a.budget_bytes / GIB, 3), "GiB (the phases' limit)", setting)
    if rows <= 0:
        raise RuntimeError(f"{tag}: the plan fits no rollout chunk ({plan_a.problem})")
    outside = 0
    if ctx.cuda:
        release(ctx)
        free, total = torch.cuda.mem_get_info()
        elsewhere = getattr(ctx, "held_elsewhere", 0)
        outside = max(total - free - torch.cuda.memory_reserved() - elsewhere, 0)
        rep.add(f"{tag}.outside_allocator_gib", round(outside / GIB, 3),
                "GiB (this process's CUDA context, NCCL, cuBLAS: held outside the allocator)", setting)
        rep.add(f"{tag}.other_process_gib", round(elsewhere / GIB, 3),
                "GiB (bench/gpu_check itself: not part of the card)", setting)
        rep.add(f"{tag}.plan_runtime_gib", round(plan_a.components["runtime"] / GIB, 3), "GiB", setting)
        if emulate:
            fraction = (card_bytes - outside) / total
            torch.cuda.set_per_process_memory_fraction(fraction)
            rep.add(f"{tag}.memory_fraction", round(fraction, 5), "of the GPU", setting)

    modes = allocator_modes(ctx)

    def record(name, plan, measured, seconds, mode=("", None, None), held_state=None):
        _, start, peak, reserved = measured
        suffix, setting_in_force, _ = mode
        planned = plan.phases["rollout" if name.startswith("rollout") else "learner"]
        name = name + suffix
        rep.add(f"{tag}.{name}.allocator", setting_in_force, "(PYTORCH_CUDA_ALLOC_CONF in force)", setting)
        if held_state is not None:
            rep.add(f"{tag}.{name}.optimizer_state_gib", round(held_state / GIB, 4),
                    "GiB of AdamW's moments held at the phase start (the plan counts them)", setting)
        allocated_plan = planned - plan.components["runtime"]
        rep.add(f"{tag}.{name}.planned_gib", round(planned / GIB, 4), "GiB (phase, runtime included)", setting)
        rep.add(f"{tag}.{name}.planned_allocated_gib", round(allocated_plan / GIB, 4), "GiB", setting)
        rep.add(f"{tag}.{name}.start_gib", round(start / GIB, 4), "GiB allocated at the phase start", setting)
        rep.add(f"{tag}.{name}.allocated_peak_gib", round(peak / GIB, 4), "GiB", setting)
        rep.add(f"{tag}.{name}.planned_allocated/allocated_peak", gcm.ratio(allocated_plan, peak), "x", setting)
        if reserved is not None:
            rep.add(f"{tag}.{name}.reserved_peak_gib", round(reserved / GIB, 4), "GiB", setting)
            rep.add(f"{tag}.{name}.reserved_above_allocated_gib", round((reserved - peak) / GIB, 4),
                    "GiB (reserved peak − allocated peak: the allocator's cache, not planned)", setting)
            rep.add(f"{tag}.{name}.device_peak_gib", round((reserved + outside) / GIB, 4),
                    "GiB (reserved + outside the allocator)", setting)
            rep.add(f"{tag}.{name}.planned/device_peak", gcm.ratio(planned, reserved + outside), "x", setting)
        rep.add(f"{tag}.{name}.seconds", round(seconds, 2), "s", setting)

    engine = learner = model = batch = None
    try:
        model = gcm.build_ouro_model(ctx)
        chunked = replace(recipe_a, rollout=replace(recipe_a.rollout, chunk_rows=rows))
        engine = make_engine(chunked, model)  # a copy: DeepSpeed does not train in place
        learner = Learner(model, recipe_a.learner, recipe_a.algorithm, batch_size=shapes["update_rows"],
                          max_len=r.max_new_tokens, rollout_dtype=engine_dtype(recipe_a))
        model = None
        gen = torch.Generator().manual_seed(7)
        vocab = model_config["vocab_size"]
        loops = int(model_config.get("total_ut_steps", 4))
        warm = warm_batch(vocab, shapes["update_rows"], group, recipe_a.data.max_prompt_tokens, r.max_new_tokens,
                          loops)

        def warm_up(lrn, name):  # AdamW's moments exist from the first step on: the plan's steady state
            t = time.perf_counter()
            lrn.update(warm)
            rep.add(f"{tag}.{name}.warm_up_s", round(time.perf_counter() - t, 2), "s (one unmeasured update first: "
                    "it makes the optimizer state)", setting)

        with rep.step(f"{tag}: warm-up update"):
            warm_up(learner, f"learner_mb{mb_a}")
        prompts = [torch.randint(1, vocab, (recipe_a.data.max_prompt_tokens,), generator=gen).tolist()
                   for _ in range(rows // group)]
        params = SamplingParams(temperature=r.temperature, max_new_tokens=r.max_new_tokens, n=group, seed=1,
                                schedule=r.schedule, exit_policy=getattr(r, "exit_policy", "sample"),
                                ignore_eos=True)
        with rep.step(f"{tag}: rollout chunk of {rows} rows"):
            for mode in modes:
                use_segments(ctx, mode[2])
                held = optimizer_state_bytes(learner)
                t = time.perf_counter()
                measured = phase(ctx, lambda: engine.generate(prompts, params))
                record("rollout", plan_a, measured, time.perf_counter() - t, mode, held)
            use_segments(ctx, modes[0][2])
            rollout = measured[0]
            rep.add(f"{tag}.rollout.tokens", int(rollout.completion_mask.sum()), "tokens", setting)
            batch = LearnerBatch.from_rollout(rollout, advantages=torch.randn(rows, generator=gen))
            batch = batch.select(slice(0, shapes["update_rows"]))
            del rollout, measured
        if batch is None:
            return
        def updates(name, plan):  # one update under each allocator setting, measured against the plan
            for mode in modes:
                use_segments(ctx, mode[2])
                held = optimizer_state_bytes(learner)
                t = time.perf_counter()
                measured = phase(ctx, lambda: learner.update(batch))
                record(name, plan, measured, time.perf_counter() - t, mode, held)
                rep.add(f"{tag}.{name}{mode[0]}.loss_finite", bool(math.isfinite(measured[0]["loss/total"])), "",
                        setting)
            use_segments(ctx, modes[0][2])

        with rep.step(f"{tag}: update at micro-batch {mb_a}"):
            updates(f"learner_mb{mb_a}", plan_a)
        with rep.step(f"{tag}: weight sync"):
            t = time.perf_counter()
            measured = phase(ctx, lambda: engine.load_weights(*learner.rollout_state_dict()))
            rep.add(f"{tag}.sync.allocated_peak_gib", round(measured[2] / GIB, 4), "GiB", setting)
            rep.add(f"{tag}.sync.seconds", round(time.perf_counter() - t, 2), "s", setting)
        close_learner(learner)
        learner = None
        release(ctx)
        with rep.step(f"{tag}: update at micro-batch {mb_b} with activation checkpointing"):
            model = copy.deepcopy(engine.model)  # a fresh policy (the first learner's is gone)
            learner = Learner(model, recipe_b.learner, recipe_b.algorithm, batch_size=shapes["update_rows"],
                              max_len=r.max_new_tokens, rollout_dtype=engine_dtype(recipe_b))
            model = None
            warm_up(learner, f"learner_mb{mb_b}_ckpt")
            updates(f"learner_mb{mb_b}_ckpt", plan_b)
    finally:
        if learner is not None:
            close_learner(learner)
        del engine, learner, model, batch
        use_segments(ctx, modes[0][2])  # the setting in force again, the cache emptied
        if ctx.cuda and emulate:
            torch.cuda.set_per_process_memory_fraction(1.0)


# -- train: rltt train with DeepSpeed, checkpoints and --resume -----------------------------------------------
def train_and_resume(ctx, rep: Report, p: dict) -> None:
    import yaml

    from rltt.cli.main import main as rltt_main
    from rltt.telemetry import read_metrics, schema

    gcm = _gc_module()
    tmp = Path(tempfile.mkdtemp(prefix="rltt-gpu-check-ds-train-"))
    path = gcm.write_smoke_run(SimpleNamespace(shapes=SimpleNamespace(smoke=p), device=ctx.device), tmp)
    raw = yaml.safe_load(path.read_text())
    raw["model"]["dtype"] = "bf16"
    raw["rollout"]["chunk_rows"] = "auto"
    raw["learner"].update(backend="deepspeed", zero_stage=2, dtype="bf16", activation_checkpointing=True)
    raw["train"].update(steps=2, eval_every=2)
    raw["checkpoint"] = {"every": 1, "save_final": True}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    run = tmp / "run"
    setting = (f"rltt train (the CLI, in this process) on {ctx.device.type}: random LoopLM d={p['hidden']}, "
               f"L={p['layers']}, T=4, GSM8K sample, {p['prompts']} prompts x G={p['group']}, {p['new_tokens']} new "
               f"tokens, learner.backend=deepspeed ZeRO-2 bf16, activation checkpointing, rollout.chunk_rows=auto, "
               f"checkpoint.every=1: 2 steps, then --resume with train.steps=3")
    start = time.perf_counter()
    code = rltt_main(["train", str(path)])
    rep.add("train.first_run_s", round(time.perf_counter() - start, 2), "s", setting)
    if code:
        raise RuntimeError(f"rltt train exited with {code} (its error is printed above)")
    first = sorted({r["step"] for r in read_metrics(run) if r["step"] > 0})
    saved = sorted(d.name for d in (run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else []
    rep.add("train.first_run_steps", len(first), "steps", setting)
    rep.add("train.checkpoints", len(saved), "checkpoints", setting)
    rep.add("train.deepspeed_state_saved", any((run / "checkpoints" / s / "deepspeed").is_dir() for s in saved), "",
            setting)
    ds_config = run / "deepspeed_config.json"
    rep.add("train.deepspeed_config_written", ds_config.is_file(), "", setting)
    if ds_config.is_file():
        written = json.loads(ds_config.read_text())
        rep.add("train.grad_accum_dtype", (written.get("data_types") or {}).get("grad_accum_dtype"), "",
                setting + "; RUN_DIR/deepspeed_config.json")
    start = time.perf_counter()
    code = rltt_main(["train", str(path), "train.steps=3", "--resume"])
    rep.add("train.resume_s", round(time.perf_counter() - start, 2), "s", setting)
    if code:
        raise RuntimeError(f"rltt train --resume exited with {code} (its error is printed above)")
    records = [r for r in read_metrics(run) if r["step"] > 0]
    steps = sorted({r["step"] for r in records})
    rep.add("train.steps_after_resume", len(steps), "steps", setting)
    last = [r for r in records if r["step"] == 3]
    for key, name in ((schema.MISMATCH_MEAN_ABS, "mismatch_mean_abs_step3"), (schema.LOSS_TOTAL, "loss_step3"),
                      (schema.MEMORY_PEAK_GB, "peak_memory_gb_step3")):
        value = last[-1].get(key) if last else None
        rep.add(f"train.{name}", value, "", setting)
    if first != [1, 2] or steps != [1, 2, 3]:
        raise RuntimeError(f"steps logged: {first} before --resume, {steps} after (expected [1, 2] and [1, 2, 3])")


# -- main ---------------------------------------------------------------------------------------------------
def run(ctx, rep: Report, shapes: dict, budget: float) -> None:
    end = time.monotonic() + budget
    plan = [("grad", lambda: grad_accumulation(ctx, rep, shapes["grad"]))]
    for tag, card_gib, emulate in shapes["cards"]:
        plan.append((tag, lambda tag=tag, g=card_gib, e=emulate: card(ctx, rep, shapes, tag, g, e)))
    plan.insert(2, ("train", lambda: train_and_resume(ctx, rep, shapes["train"])))
    for name, fn in plan:
        estimate = shapes["estimates"][name]
        if end - time.monotonic() < estimate:
            rep.skipped.append(f"{name}: {end - time.monotonic():.0f} s left of the budget, estimate {estimate} s")
            rep.write()
            continue
        start = time.perf_counter()
        print(f"[gpu_check deepspeed] {name}: start", flush=True)
        with rep.step(name):
            fn()
        rep.add(f"{name}.seconds", round(time.perf_counter() - start, 2), "s", f"the {name} sub-step, all of it")
        release(ctx)
        rep.write()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for all sub-steps")
    parser.add_argument("--held-elsewhere", type=int, default=0,
                        help="GPU bytes the calling process holds (left out of this process's 80 GB card)")
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        from rltt.runtime.allocator import configure
    except ImportError:  # an rltt without it: PyTorch's default stays, and the figures say so
        pass
    else:
        configure()  # as `rltt train` does, before CUDA initialises: expandable segments unless the caller chose
    import importlib.util

    rep = Report(args.out)
    if importlib.util.find_spec("deepspeed") is None:
        (args.out / "deepspeed.json").write_text(json.dumps(dict(
            absent="DeepSpeed is not installed in this environment (pip install 'rltt[deepspeed]'; on the GPU "
                   "image: the wheels bench/gpu_bundle.sh builds)")))
        return 0
    rep.write()
    import torch

    if args.cpu_smoke:
        torch.set_num_threads(1)
    ctx = _gc_module().Context(args.cpu_smoke, 1.0)
    ctx.held_elsewhere = args.held_elsewhere
    run(ctx, rep, CPU if args.cpu_smoke else GPU, args.budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
