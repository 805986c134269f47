"""One prepared GPU check: Triton kernels, rollouts, the learner, DeepSpeed and ``rltt train`` on one GPU.

Device command (one H200 with the image's torch 2.11.0+cu130, triton 3.6.0 and transformers
5.17.0, from the repository root, after ``bash bench/gpu_bundle.sh`` here: the device tool carries
``.gpu_bundle``, the DeepSpeed wheels the image lacks; the section budgets sum to 537 s without
vLLM's, whose section records "absent" in a second on the image, so it finishes within 9 minutes;
run-tool timeout 590 s; writes ``$OUT/gpu_check.json``, ``$OUT/gpu_check.md`` and the log):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu_bundle/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && set -o pipefail && timeout 560 python3 bench/gpu_check.py --out $OUT 2>&1 | tee $OUT/gpu_check.log

The JSON and Markdown are rewritten after every section, and on SIGTERM (the outer ``timeout``) with
the running section's figures, so a run stopped early keeps what it measured; the log has every
sub-step's start and elapsed time. A rerun of some sections only: ``--sections kernels,learner``. CPU mode (the same code
paths at the smallest shapes, in seconds; ``tests/bench/test_gpu_check.py`` runs it):

    python bench/gpu_check.py --cpu-smoke --out /tmp/gpu_check     # or: rltt bench gpu_check --cpu-smoke ...

Sections (each guarded: a failure, of the section or of one sub-step, is recorded with its error
text and the rest still runs; each has a time budget: a sub-step the time left cannot cover is
skipped and recorded as skipped, and an alarm ends the section at its budget):

- ``imports``: every ``rltt`` module imports with deepspeed, ray and vllm absent (they are made
  unimportable for the whole run, as on the GPU image) and the Hugging Face hub offline;
- ``kernels``: the Triton per-loop log-prob kernels (compiled for CUDA; Triton's interpreter in
  CPU mode) and the chunked path against the naive reference, values and gradients, fp32 and
  bf16, awkward shapes; then time and peak memory of naive, chunked and Triton (bf16, T = 4,
  d = 2048, V = 151,936, N = 8192 and N = 1024);
- ``rollouts``: a random LoopLM shaped like Ouro-1.4B (its config.json through
  ``rltt.model.ouro.ouro_to_loop_config``: d = 2048, L = 24, T = 4, V = 49,152) in bf16, the exit
  gate's weight zeroed and its bias set so that E[t*] = 2.5 under the ``sample`` exit policy; in
  this order (the cheapest and most telling first; a sub-step the time left cannot cover is skipped):
  one SDPA call's cost at a new key length against a repeat, default backends and cuDNN's off (the
  engine's setting); the native engine with ``rollout.cuda_graphs`` on and off at batch 32 (host
  work per pass — operators per layer-pass, syncs and reads per pass —, tokens/s, replay bitwise
  with the graphs, the buckets' and graph pool's bytes against the plan; on CPU "on" is the same
  bucketed passes run eagerly); ``rollout.attention: triton`` with the graphs on at that batch and
  length, each bucketed pass captured whole (one graph per bucket and step kind, the KV writes and
  the slot attention inside it; that capture never run on a GPU before; it has no budget of its
  own): tokens/s of deferred and dense and their ratio to the SDPA figures just measured, host work
  per pass, rows whose tokens and exits equal SDPA's and the log-probs' largest difference on
  them, and a sampled deferred rollout's
  ``replay_logprobs`` bitwise, a compile or launch error recorded as that sub-step's failure (with
  whether CUDA still works after it); ``replay_logprobs`` bitwise against a sampled deferred
  rollout; native ``dense`` vs ``deferred`` at batch 1 / 8 / 32 / 256 with 128 new tokens (greedy
  tokens, sampled exits); native final-exit decoding vs transformers' ``generate()`` at batch 32;
- ``learner``: one RL learner step (packed scoring, backward, AdamW) on that model, after a
  warm-up step: tokens per second and peak memory;
- ``plan``: `rltt plan`'s rollout and learner phase peaks (less its runtime component) against
  ``max_memory_allocated`` around ``engine.generate`` and ``learner.update`` (peak stats reset at
  each phase's start) of a train-like step on that model: the engine and learner of a torch-bf16
  recipe built by ``rltt train``'s factories (a reference copy for ``track_kl``), 4 prompts × G = 8,
  64 + 128 tokens, micro-batch 8; two steps, the second measured; without and with
  ``learner.activation_checkpointing`` (target: planned/measured within 0.85–1.15; on CPU the same
  comparison is bench/scale.py's, whose meter the CPU mode uses);
- ``deepspeed``: bench/gpu_check_deepspeed.py in its own process (the default GPU path: DeepSpeed
  ZeRO-2, bf16): one update's accumulated gradient against the fp32 sum of its micro-batch
  gradients; recipes/gsm8k.yaml on an 80 GB card (emulated with
  ``torch.cuda.set_per_process_memory_fraction``) and on the whole GPU — one rollout chunk of the
  plan's rows at the recipe's lengths, one update at micro-batch 4 without and one at 16 with
  activation checkpointing, allocated and reserved peaks against `rltt plan`'s phases; ``rltt
  train`` with DeepSpeed, ``chunk_rows: auto`` and checkpointing for 2 steps, then ``--resume``.
  Where DeepSpeed is not installed the section is ``absent`` with that note;
- ``vllm``: bench/gpu_check_vllm.py in its own process: `rltt.vllm.VllmEngine` on the rollouts
  section's model with CUDA graphs on: greedy tokens and sampled exits against the native dense
  schedule, tokens/s at batch 64 and 256, and two in-place weight loads visible in the outputs
  (each against the native engine on the same weights). Where vLLM is not installed (the bare
  GPU image) the section is ``absent`` with that note, not a failure;
- ``smoke``: 5 steps of ``rltt train`` (the CLI's entry point, in-process) with a small random
  LoopLM and a locally trained tokenizer, on the GSM8K sample shipped with rltt.

Needs only torch, triton, transformers and rltt itself (and DeepSpeed for its section). Targets
(recorded, not asserted): deferred >= 1.5x dense tokens/s at batch >= 8; native >= 2x
``generate()`` at batch 32; the Triton kernel <= 1/20 of the naive peak memory and <= 1x its time;
the memory plan within 15 % of the measured phase peaks; DeepSpeed's accumulated gradient within
one bf16 rounding of the fp32 sum.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("deepspeed", "ray", "vllm")
SECTIONS = ("imports", "kernels", "rollouts", "learner", "plan", "deepspeed", "vllm", "smoke")
GIB = 1024 ** 3  # rltt.telemetry.schema.GIB's value: this script imports rltt only inside its sections (a failed import is a figure)

# Ouro-1.4B's config.json (the fields rltt's importer reads); random weights.
OURO_1_4B = dict(model_type="ouro", vocab_size=49152, hidden_size=2048, intermediate_size=5632,
                 num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, hidden_act="silu",
                 max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 tie_word_embeddings=False, total_ut_steps=4)


@dataclass
class Shapes:
    """Every size the check uses; ``gpu()`` is the device run, ``cpu_smoke()`` the smallest."""

    budgets: dict
    kernel_checks: list  # (T, N, d, V, temperature, masked)
    kernel_times: list  # (T, N, d, V)
    kernel_reps: int
    model: dict  # Ouro-style config.json fields
    batches: list
    new_tokens: int
    prompt_len: int
    generate_batch: int
    replay_batch: int
    graphs_batch: int  # rows of the CUDA graphs on/off comparison (>= 4: passes of fewer items are not bucketed)
    learner: dict  # prompts, group, prompt_len, completion_len, micro
    plan: dict  # prompts, group, prompt_len, new_tokens, micro: the train-like step of the plan section
    smoke: dict

    @staticmethod
    def gpu() -> "Shapes":
        return Shapes(
            # from the H200's second run (bench/gpu_runs/2026-12-04b/full.log, at 3c0d387, cuDNN attention off):
            # imports 9.6 s, kernels 38 s (its N = 1024 timing skipped), learner 19 s (its timed step
            # skipped: the first step took 19 s), plan 47 s, deepspeed 112 s (card141 skipped: 120 s
            # estimated), smoke 18 s; rollouts ran out at 148 s, in the batch sweep's first batch size, and a
            # rerun with 364 s reached the same point (the sweep's host-work profile at 128 tokens). So
            # rollouts gets what smoke and deepspeed no longer need; 537 s without vLLM's, under
            # `timeout 560`. The Triton attention sub-step (after the graphs comparison) has no time of its
            # own (TRITON_ATTENTION_S to start)
            budgets=dict(imports=12, kernels=50, rollouts=190, learner=35, plan=55, deepspeed=160, vllm=150,
                         smoke=35),
            kernel_checks=[(3, 37, 200, 1001, 1.0, False), (2, 130, 72, 32003, 0.7, True),
                           (4, 5, 2048, 151936, 1.0, False), (1, 1, 64, 64, 1.3, False)],
            kernel_times=[(4, 8192, 2048, 151936), (4, 1024, 2048, 151936)], kernel_reps=3,
            model=OURO_1_4B, batches=[1, 8, 32, 256], new_tokens=128, prompt_len=32, generate_batch=32,
            replay_batch=8, graphs_batch=32,
            learner=dict(prompts=8, group=8, prompt_len=128, completion_len=384, micro=8),
            plan=dict(prompts=4, group=8, prompt_len=64, new_tokens=128, micro=8),
            smoke=dict(hidden=128, layers=2, heads=4, prompts=8, group=8, new_tokens=64, eval_size=32,
                       micro=16, dtype="bf16", threads=0))

    @staticmethod
    def cpu_smoke() -> "Shapes":
        small = dict(OURO_1_4B, vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
        return Shapes(
            budgets=dict(imports=30, kernels=60, rollouts=60, learner=40, plan=50, deepspeed=300, vllm=240,
                         smoke=90),
            kernel_checks=[(3, 7, 24, 101, 1.0, False), (2, 6, 16, 70, 0.7, True)],
            kernel_times=[(2, 8, 16, 128), (2, 4, 16, 128)], kernel_reps=1,
            model=small, batches=[1, 2], new_tokens=3, prompt_len=4, generate_batch=2, replay_batch=2, graphs_batch=4,
            learner=dict(prompts=1, group=2, prompt_len=4, completion_len=4, micro=2),
            plan=dict(prompts=2, group=2, prompt_len=6, new_tokens=4, micro=2),
            smoke=dict(hidden=16, layers=1, heads=2, prompts=1, group=2, new_tokens=4, eval_size=2,
                       micro=2, dtype="fp32", threads=1))


# -- the report ------------------------------------------------------------------------------------
@dataclass
class Figure:
    name: str
    value: object
    unit: str = ""
    setting: str = ""


@dataclass
class SectionResult:
    name: str
    budget_s: float
    status: str = "not run"  # ok | partial (sub-steps skipped for time) | error (the section or a sub-step failed)
    #                          | absent (what it checks is not installed: a note, not a failure)
    seconds: float = 0.0
    error: str | None = None
    skipped: list = field(default_factory=list)
    failures: list = field(default_factory=list)  # sub-steps that failed while the section went on
    figures: list = field(default_factory=list)
    absent: str | None = None  # why the section had nothing to check (e.g. vLLM not installed)

    def add(self, name: str, value, unit: str = "", setting: str = "") -> None:
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)  # JSON has no inf/nan
        self.figures.append(Figure(name, value, unit, setting))

    def skip(self, what: str) -> None:
        self.skipped.append(what)

    current = None  # the sub-step running now (not fields: not in the JSON)
    cut_in = None  # the sub-step a time-out or SIGTERM ended

    def log(self, what: str) -> None:
        log(f"{self.name}: {what}")

    @contextmanager
    def step(self, what: str):
        """One sub-step: its start and elapsed time go to the log; an exception is recorded as a failure
        and the section goes on (the section's time-out, a BaseException, still ends it)."""
        start, outer = time.perf_counter(), self.current
        self.current = what
        self.log(f"{what}: start")
        try:
            yield
            self.log(f"{what}: done in {time.perf_counter() - start:.1f} s")
        except Exception as exc:  # noqa: BLE001 - recorded (one line: a Triton compile error spans many)
            self.failures.append(" ".join(f"{what}: {type(exc).__name__}: {exc}".split())[:1000])
            print(f"[gpu_check] {self.name}: {what} FAILED after {time.perf_counter() - start:.1f} s\n"
                  f"{traceback.format_exc()}", flush=True)
        except BaseException:  # the section's alarm or SIGTERM: name the innermost sub-step it cut
            self.cut_in = self.cut_in or what
            self.log(f"{what}: cut after {time.perf_counter() - start:.1f} s")
            raise
        finally:
            self.current = outer


_T0 = time.monotonic()


def log(message: str) -> None:
    """One line of the log with the seconds since the start, flushed (a killed run shows where it was)."""
    print(f"[gpu_check {time.monotonic() - _T0:6.1f}s] {message}", flush=True)


class SectionTimeout(BaseException):
    """Raised by the section alarm (a BaseException, so library code catching Exception lets it pass)."""


class Terminated(BaseException):
    """Raised by SIGTERM (the outer ``timeout``): the run writes what it measured and exits."""


def on_sigterm(signum, frame):
    raise Terminated("SIGTERM (the outer timeout?)")


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, estimate: float) -> bool:
        return self.left() > estimate


@contextmanager
def alarm(seconds: float, name: str):
    """Hard limit of one section: SIGALRM raises SectionTimeout between Python bytecodes."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise SectionTimeout(f"section {name!r} ran past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    start = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:  # an alarm set by the caller (e.g. a test timeout) keeps running
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


def run_section(name: str, fn, ctx: "Context") -> SectionResult:
    budget = ctx.shapes.budgets[name] * ctx.budget_scale
    result = SectionResult(name, budget)
    ctx.running = result
    start = time.perf_counter()
    log(f"{name}: start (budget {budget:.0f} s)")
    try:
        with alarm(budget, name):
            fn(ctx, result, Deadline(budget))
        result.status = ("error" if result.failures else "partial" if result.skipped else
                         "absent" if result.absent else "ok")
    except (Exception, SectionTimeout, Terminated) as exc:  # noqa: BLE001 - recorded; the other sections still run
        result.status = "error"
        where = f" (in sub-step {result.cut_in!r})" if result.cut_in else ""
        result.failures.append(f"{type(exc).__name__}{where}: {exc}".strip()[:2000])
        print(f"[gpu_check] {name}: ERROR\n{traceback.format_exc()}", flush=True)
        if isinstance(exc, Terminated):
            result.error = " | ".join(result.failures)
            result.seconds = round(time.perf_counter() - start, 2)
            raise
    finally:
        result.error = " | ".join(result.failures) or None
        result.seconds = round(time.perf_counter() - start, 2)
        ctx.release()
    log(f"{name}: {result.status} in {result.seconds:.1f} s")
    return result


# -- environment -------------------------------------------------------------------------------------
def block_heavy_modules() -> None:
    """Make deepspeed, ray and vllm unimportable (``import`` raises ImportError and
    ``importlib.util.find_spec`` returns None), as on the GPU image, for this process."""
    for name in HEAVY:
        sys.modules[name] = None


def environment(ctx: "Context") -> dict:
    import torch
    import transformers

    env = dict(mode="cpu-smoke" if ctx.cpu_smoke else "gpu", device=str(ctx.device), python=platform.python_version(),
               torch=torch.__version__, transformers=transformers.__version__,
               torch_cuda=torch.version.cuda, triton_interpret=os.environ.get("TRITON_INTERPRET", ""),
               hf_hub_offline=os.environ.get("HF_HUB_OFFLINE", ""))
    for pkg in ("triton", "tokenizers"):
        try:
            env[pkg] = importlib.import_module(pkg).__version__
        except Exception as exc:  # noqa: BLE001
            env[pkg] = f"unavailable ({type(exc).__name__})"
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        env.update(gpu=torch.cuda.get_device_name(ctx.device), gpu_memory_gib=round(props.total_memory / GIB, 1),
                   gpu_capability=f"{props.major}.{props.minor}", gpu_sms=props.multi_processor_count)
    else:
        env.update(gpu="none (CPU)", cpu_threads=torch.get_num_threads())
    try:
        env["rltt_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - no git on the device machine
        env["rltt_commit"] = "unknown"
    return env


class Context:
    def __init__(self, cpu_smoke: bool, budget_scale: float):
        import torch

        self.cpu_smoke = cpu_smoke
        self.shapes = Shapes.cpu_smoke() if cpu_smoke else Shapes.gpu()
        self.budget_scale = budget_scale
        self.device = torch.device("cpu" if cpu_smoke else "cuda")
        self._model = None
        self.running: SectionResult | None = None  # the section now running (written on SIGTERM)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def timed(self, fn):
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - start, out

    def ouro_model(self):
        """The Ouro-shaped random LoopLM in bf16 (built once, shared by rollouts and learner)."""
        if self._model is None:
            self._model = build_ouro_model(self)
        return self._model

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()


# -- memory meters ------------------------------------------------------------------------------------
def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory of a block: CUDA ``max_memory_allocated`` (absolute and above the allocation at
    the start), or on CPU the peak RSS (``VmHWM`` reset through ``/proc/self/clear_refs``)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.peak_gib = self.extra_gib = None

    def __enter__(self):
        import torch

        self.ctx.sync()
        if self.ctx.cuda:
            self.base = torch.cuda.memory_allocated(self.ctx.device)
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
            self.base = (_status_kib("VmRSS") or 0) * 1024
        return self

    def __exit__(self, *exc):
        import torch

        self.ctx.sync()
        if self.ctx.cuda:
            peak = torch.cuda.max_memory_allocated(self.ctx.device)
        else:
            hwm = _status_kib("VmHWM")
            peak = None if hwm is None else hwm * 1024
        if peak is not None:
            self.peak_gib = round(peak / GIB, 4)
            self.extra_gib = round(max(peak - self.base, 0) / GIB, 4)
        return False


def ratio(a, b):
    return round(a / b, 4) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


# -- imports ------------------------------------------------------------------------------------------
def section_imports(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    import pkgutil

    import rltt

    failed, count = [], 0
    # the optional layers that exist to drive ray / vllm need them by design; everything else must not
    optional = ("rltt.vllm", "rltt.orchestration.ray")
    for info in pkgutil.walk_packages(rltt.__path__, "rltt."):
        if info.name.startswith(optional) and info.name not in optional:
            continue
        count += 1
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # noqa: BLE001 - recorded
            failed.append(f"{info.name}: {type(exc).__name__}: {exc}"[:300])
    for name in ("rewards.gsm8k", "rewards.format"):
        count += 1
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001
            failed.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY and sys.modules[m] is not None)
    setting = ("deepspeed, ray, vllm made unimportable; HF_HUB_OFFLINE=1; every rltt module but those under "
               "rltt.vllm and rltt.orchestration.ray (they drive vllm / ray)")
    sec.add("modules_imported", count - len(failed), "modules", setting)
    sec.add("modules_failed", len(failed), "modules", setting + ("; failed: " + "; ".join(failed) if failed else ""))
    sec.add("heavy_modules_loaded", len(loaded), "modules",
            setting + ("; loaded: " + ", ".join(loaded) if loaded else ""))
    if failed:
        raise RuntimeError(f"{len(failed)} rltt module(s) failed to import: {failed[0]}")


# -- kernels ------------------------------------------------------------------------------------------
def _kernel_inputs(ctx, steps, n, d, vocab, dtype, seed=0):
    import torch

    dev = ctx.device
    gen = torch.Generator(device=dev).manual_seed(seed)  # drawn on the device: V x d at V = 152k is large
    hidden = torch.randn(steps, n, d, generator=gen, device=dev).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, d, generator=gen, device=dev) / d ** 0.5 * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=gen, device=dev)
    return hidden, weight, targets


def _values_and_grads(fn, hidden, weight, cotangents):
    import torch

    out = fn()
    loss = (out.logprobs * cotangents[0]).sum() + (out.entropy * cotangents[1]).sum()
    gh, gw = torch.autograd.grad(loss, [hidden, weight])
    return out.logprobs.detach(), out.entropy.detach(), gh, gw


# tolerances: values |got - ref| <= atol + rtol |ref|; gradients max |got - ref| / max |ref|
VALUE_TOL = dict(atol=1e-4, rtol=1e-5)
GRAD_TOL = {"fp32": 1e-4, "bf16": 2e-2}


def kernel_checks(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    import torch

    from rltt.kernels import per_loop_logprobs
    from rltt.kernels.reference import reference_logprobs

    shapes = ctx.shapes.kernel_checks
    where = ("CUDA, compiled" if ctx.cuda else "CPU, Triton interpreter")
    shape_text = "; ".join(f"T={t} N={n} d={d} V={v} temp={tp}{' masked' if m else ''}"
                           for t, n, d, v, tp, m in shapes)
    all_ok = True
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        errors = {impl: dict(lp=0.0, ent=0.0, grad=0.0, ok=True) for impl in ("triton", "chunked")}
        for case, (steps, n, d, vocab, temp, masked) in enumerate(shapes):
            hidden, weight, targets = _kernel_inputs(ctx, steps, n, d, vocab, dtype, seed=case)
            mask = None
            if masked:
                mask = (torch.arange(n, device=ctx.device) % 3 != 1)
                targets = torch.where(mask, targets, torch.full_like(targets, -100))
            gen = torch.Generator(device=ctx.device).manual_seed(100 + case)
            cot = (torch.randn(steps, n, generator=gen, device=ctx.device),
                   torch.randn(steps, n, generator=gen, device=ctx.device))
            ref = _values_and_grads(lambda: reference_logprobs(hidden, weight, targets, temperature=temp, mask=mask),
                                    hidden, weight, cot)
            for impl, err in errors.items():
                ran = False
                with sec.step(f"check {impl} {dname} T={steps} N={n} d={d} V={vocab}"):
                    got = _values_and_grads(lambda: per_loop_logprobs(hidden, weight, targets, temperature=temp,
                                                                      mask=mask, impl=impl), hidden, weight, cot)
                    for key, g, r in (("lp", got[0], ref[0]), ("ent", got[1], ref[1])):
                        diff = (g - r).abs()
                        err[key] = max(err[key], float(diff.max()))
                        err["ok"] &= bool((diff <= VALUE_TOL["atol"] + VALUE_TOL["rtol"] * r.abs()).all())
                    for g, r in ((got[2], ref[2]), (got[3], ref[3])):
                        err["ok"] &= g.dtype == r.dtype
                        rel = float((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6))
                        err["grad"] = max(err["grad"], rel)
                    err["ok"] &= err["grad"] <= GRAD_TOL[dname]
                    ran = True
                err["ok"] &= ran
            hidden = weight = targets = ref = None  # free the device memory before the next shape
        setting = (f"{where}; {dname}; {shape_text}; vs the naive reference; ok: values within atol "
                   f"{VALUE_TOL['atol']:g} + rtol {VALUE_TOL['rtol']:g}, gradients within {GRAD_TOL[dname]:g} of "
                   f"max |grad| and in the input dtype")
        for impl, err in errors.items():
            sec.add(f"check.{impl}.{dname}.logprob_max_abs_err", err["lp"], "nats", setting)
            sec.add(f"check.{impl}.{dname}.entropy_max_abs_err", err["ent"], "nats", setting)
            sec.add(f"check.{impl}.{dname}.grad_max_rel_err", err["grad"], "of max |grad|", setting)
            sec.add(f"check.{impl}.{dname}.ok", err["ok"], "", setting)
            all_ok &= err["ok"]
    sec.add("check.all_ok", all_ok, "", "every implementation, dtype and shape above")


def _time_impl(ctx: Context, impl: str, shape, reps: int):
    """(ms per forward+backward, extra peak GiB above the inputs) or (None, 'OOM')."""
    import torch

    from rltt.kernels import per_loop_logprobs

    steps, n, d, vocab = shape
    hidden, weight, targets = _kernel_inputs(ctx, steps, n, d, vocab, torch.bfloat16)

    def one():
        out = per_loop_logprobs(hidden, weight, targets, impl=impl)
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
        hidden.grad = weight.grad = None

    try:
        one()  # warm-up (Triton compiles here)
        with PeakMemory(ctx) as mem:
            seconds, _ = ctx.timed(lambda: [one() for _ in range(reps)])
        return seconds / reps * 1e3, mem.extra_gib
    except torch.cuda.OutOfMemoryError:
        return None, "OOM"
    finally:
        hidden = weight = targets = None  # free the device memory before the next shape
        ctx.release()


def kernel_times(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    reps = ctx.shapes.kernel_reps
    last = 0.0
    for shape in ctx.shapes.kernel_times:
        steps, n, d, vocab = shape
        tag = f"N{n}"
        setting = (f"bf16, T={steps}, N={n}, d={d}, V={vocab}, forward+backward, mean of {reps} after 1 warm-up; "
                   f"memory = peak above the inputs ({'max_memory_allocated' if ctx.cuda else 'peak RSS'})")
        if not deadline.allows(last):
            sec.skip(f"kernel timing at {tag}")
            continue
        start = time.perf_counter()
        rows = {}
        for impl in ("reference", "chunked", "triton"):
            rows[impl] = (None, None)
            with sec.step(f"timing {impl} at {tag}"):
                rows[impl] = _time_impl(ctx, impl, shape, reps)
            name = "naive" if impl == "reference" else impl
            ms, gib = rows[impl]
            sec.add(f"time.{tag}.{name}_ms", None if ms is None else round(ms, 3), "ms", setting)
            sec.add(f"memory.{tag}.{name}_gib", gib, "GiB", setting)
        naive = rows["reference"]
        for impl in ("chunked", "triton"):
            sec.add(f"ratio.{tag}.{impl}/naive_time", ratio(rows[impl][0], naive[0]), "x",
                    setting + ("; naive OOM" if naive[0] is None else ""))
            sec.add(f"ratio.{tag}.{impl}/naive_memory", ratio(rows[impl][1], naive[1]), "x",
                    setting + ("; naive OOM" if naive[0] is None else ""))
        last = time.perf_counter() - start


def section_kernels(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    from rltt.kernels import resolve_impl

    sec.add("auto_impl", resolve_impl("auto", ctx.device), "", f"rltt.kernels auto choice on {ctx.device.type}")
    kernel_checks(ctx, sec, deadline)
    kernel_times(ctx, sec, deadline)


# -- the Ouro-shaped model and rollouts ------------------------------------------------------------------
MEAN_EXIT = 2.5




def build_ouro_model(ctx: Context):
    import torch

    from rltt.model import LoopedForCausalLM
    from rltt.model.ouro import ouro_to_loop_config

    cfg = ouro_to_loop_config(ctx.shapes.model, exit_policy="final")
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LoopedForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    from rltt.model.exits import gate_lambda

    lam = gate_lambda(MEAN_EXIT, cfg.num_loops)
    with torch.no_grad():
        model.model.exit_gate.weight.zero_()
        model.model.exit_gate.bias.fill_(math.log(lam / (1 - lam)))
    return model


def model_setting(model) -> str:
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    return (f"random LoopLM (Ouro-1.4B shape) d={c.hidden_size}, L={c.num_hidden_layers}, T={c.num_loops}, "
            f"V={c.vocab_size}, heads {c.num_attention_heads}/{c.num_key_value_heads}, {params:,} parameters, bf16")


def section_rollouts(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    import torch

    from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs

    build_s, model = ctx.timed(ctx.ouro_model)
    s = ctx.shapes
    vocab = model.config.vocab_size
    base = model_setting(model)
    sec.add("model_build_s", round(build_s, 2), "s", base)
    base += "; rollout.cuda_graphs null (on with CUDA, off on CPU) unless stated"
    engine = NativeEngine(model)

    def prompts(bsz, seed):
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(1, vocab, (bsz, s.prompt_len), generator=gen)

    def native(ids, schedule, policy, new_tokens=s.new_tokens, temperature=0.0, seed=1):
        return engine.generate(ids.tolist(), SamplingParams(
            temperature=temperature, max_new_tokens=new_tokens, exit_policy=policy, schedule=schedule, seed=seed,
            ignore_eos=True))

    # cheapest and most telling first: the attention's per-shape cost, CUDA graphs on/off with the host
    # work per pass, the Triton attention, bitwise replay; then the batch sweep and generate(); a sub-step
    # the time left cannot cover is skipped (recorded), not cut by the section's alarm
    with sec.step("attention cost per new shape"):
        attention_shape_cost(ctx, sec, model, base)
    warm = prompts(min(8, s.batches[-1]), 0)
    with sec.step("warm-up (dense and deferred, 4 tokens)"):
        for schedule in ("dense", "deferred"):
            native(warm, schedule, "sample", new_tokens=4)

    sdpa_on: dict = {}  # the graphs-on SDPA rollouts, compared with the Triton attention's at the end
    with sec.step("CUDA graphs on and off"):
        cuda_graphs_on_off(ctx, sec, model, prompts(s.graphs_batch, 5), base, deadline, kept=sdpa_on)

    # next, since it was never run on a GPU: rollout.attention triton at the graphs comparison's batch and
    # length, against that sub-step's SDPA rollouts (a compile error or a failed launch is recorded as this
    # sub-step's failure)
    if not deadline.allows(TRITON_ATTENTION_S if ctx.cuda else 1):
        sec.skip("Triton attention (rollout.attention: triton)")
    else:
        failed = len(sec.failures)
        with sec.step("Triton attention (rollout.attention: triton)"):
            triton_attention(ctx, sec, model, prompts(s.graphs_batch, 5), base, deadline, sdpa_on)
        if ctx.cuda and len(sec.failures) > failed:  # a failed launch can leave the CUDA context unusable
            sec.add("triton.cuda_usable_after_failure", cuda_usable(), "",
                    f"{base}; after the Triton attention sub-step failed: a tiny CUDA op and a synchronize still "
                    f"succeed (if not, the later in-process sections fail for this reason)")

    rb = s.replay_batch
    setting = (f"{base}; batch {rb}, prompt {s.prompt_len}, {s.new_tokens} new tokens, temperature 1, sampled "
               f"exits, deferred; replay_logprobs vs the rollout's recorded log-probs")
    if not deadline.allows(15 if ctx.cuda else 1):  # 5.7 s of replay after its rollout on the H200
        sec.skip("bitwise replay")
    else:
        with sec.step("bitwise replay"):
            batch = native(prompts(rb, 7), "deferred", "sample", temperature=1.0, seed=11)
            t_replay, replayed = ctx.timed(lambda: replay_logprobs(model, batch))
            got, want = replayed.logprobs.cpu(), batch.logprobs.cpu()
            equal = (torch.equal(got, want)
                     and torch.equal(replayed.tempered_logprobs.cpu(), batch.tempered_logprobs.cpu()))
            sec.add("replay.bitwise_equal", bool(equal), "", setting)
            sec.add("replay.max_abs_diff", float((got - want).abs().max()), "nats", setting)
            sec.add("replay.seconds", round(t_replay, 3), "s", setting)

    last = 0.0
    for bsz in s.batches:
        setting = (f"{base}; batch {bsz}, prompt {s.prompt_len}, {s.new_tokens} new tokens, greedy tokens, "
                   f"sampled exits (gate bias for E[t*]={MEAN_EXIT}), one timed run of each after a warm-up; "
                   f"target deferred >= 1.5x dense at batch >= 8")
        # the next batch size takes longer than the last; the first: 4 runs of 128 tokens at batch 1
        if not deadline.allows(2.5 * last if last else (20 if ctx.cuda else 0)):
            sec.skip(f"dense vs deferred at batch {bsz}")
            continue
        with sec.step(f"dense vs deferred at batch {bsz}"):
            ids = prompts(bsz, bsz)
            start = time.perf_counter()
            t_dense, dense = ctx.timed(lambda: native(ids, "dense", "sample"))
            t_def, deferred = ctx.timed(lambda: native(ids, "deferred", "sample"))
            last = time.perf_counter() - start
            tokens = bsz * s.new_tokens
            sec.add(f"rollout.b{bsz}.dense_tok_s", round(tokens / t_dense, 2), "tok/s", setting)
            sec.add(f"rollout.b{bsz}.deferred_tok_s", round(tokens / t_def, 2), "tok/s", setting)
            sec.add(f"rollout.b{bsz}.deferred/dense", ratio(t_dense, t_def), "x", setting)
            exits = deferred.exit_steps.cpu()[deferred.completion_mask.cpu()]
            sec.add(f"rollout.b{bsz}.mean_exit_step", round(float(exits.float().mean()), 3), "steps", setting)
            sec.add(f"rollout.b{bsz}.passes_per_token_dense", round(dense.stats.passes_per_token, 3), "passes",
                    setting)
            sec.add(f"rollout.b{bsz}.passes_per_token_deferred", round(deferred.stats.passes_per_token, 3), "passes",
                    setting)
            sec.add(f"rollout.b{bsz}.same_tokens_and_exits",
                    bool(torch.equal(dense.exit_steps.cpu(), deferred.exit_steps.cpu())
                         and torch.equal(dense.completion_ids.cpu(), deferred.completion_ids.cpu())), "", setting)
            if bsz == s.batches[0]:  # host work per pass (rltt.rollout.host_work: profiler counts, one call each
                # of HOST_WORK_TOKENS tokens: under the profiler 128 tokens at batch 1 took over 100 s on the H200)
                from rltt.rollout.host_work import rollout_host_work
                for schedule in ("dense", "deferred"):
                    _, work = rollout_host_work(engine, ids.tolist(), SamplingParams(
                        temperature=0.0, max_new_tokens=min(s.new_tokens, HOST_WORK_TOKENS), exit_policy="sample",
                        schedule=schedule,
                        seed=1, ignore_eos=True), warmup=False)
                    for key, value in work.summary().items():
                        sec.add(f"rollout.b{bsz}.{schedule}.{key}", round(value, 3), "",
                                f"{setting}; host work profiled over {min(s.new_tokens, HOST_WORK_TOKENS)} new tokens")
            del dense, deferred

    gb = s.generate_batch
    setting = (f"{base}; batch {gb}, prompt {s.prompt_len}, {s.new_tokens} new tokens, greedy, final exits "
               f"(native deferred schedule vs transformers generate(), same FLOPs per token), one timed run after "
               f"a warm-up; target native >= 2x; bf16 rounding may split greedy paths")
    if not deadline.allows(30 if ctx.cuda else 1):
        sec.skip(f"native vs generate() at batch {gb}")
    else:
        with sec.step(f"native vs generate() at batch {gb}"):
            ids = prompts(gb, 1000 + gb)
            t_native, out = ctx.timed(lambda: native(ids, "deferred", "final"))
            with torch.no_grad():
                hf_ids = ids.to(ctx.device)
                model.generate(hf_ids[:, :4], max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
                t_hf, hf = ctx.timed(lambda: model.generate(hf_ids, max_new_tokens=s.new_tokens,
                                                            min_new_tokens=s.new_tokens, do_sample=False,
                                                            pad_token_id=0))
            tokens = gb * s.new_tokens
            same_rows = (out.completion_ids.cpu() == hf[:, s.prompt_len:].cpu()).all(dim=1).float().mean()
            sec.add(f"generate.b{gb}.native_final_tok_s", round(tokens / t_native, 2), "tok/s", setting)
            sec.add(f"generate.b{gb}.hf_generate_tok_s", round(tokens / t_hf, 2), "tok/s", setting)
            sec.add(f"generate.b{gb}.native/generate", ratio(t_hf, t_native), "x", setting)
            sec.add(f"generate.b{gb}.identical_rows_frac", round(float(same_rows), 4), "", setting)
            del out, hf

@contextmanager
def engine_calls(sec: SectionResult):
    """Log every `NativeEngine.generate` call while active (rows, passes, tokens, seconds, captures): where
    a train step's rollout time goes, in the log even when the section is cut short."""
    from rltt.rollout.native import NativeEngine

    plain = NativeEngine.generate
    calls = []

    def logged(self, prompts, params):
        before = self.buckets.captures if self.buckets is not None else 0
        start = time.perf_counter()
        sec.log(f"generate: {len(prompts)} prompts x n={params.n}, up to {params.max_new_tokens} tokens, "
                f"{params.schedule}: start")
        out = plain(self, prompts, params)
        seconds = time.perf_counter() - start
        captures = (self.buckets.captures if self.buckets is not None else 0) - before
        passes = int(out.stats.passes)
        calls.append(seconds)
        sec.log(f"generate: {passes} passes, {int(out.stats.tokens)} tokens in {seconds:.2f} s "
                f"({1e3 * seconds / max(passes, 1):.1f} ms/pass), {captures} new captures")
        return out

    NativeEngine.generate = logged
    try:
        yield calls
    finally:
        NativeEngine.generate = plain


def attention_shape_cost(ctx: Context, sec: SectionResult, model, base: str, calls: int = 6) -> None:
    """What one SDPA call of the engine's decode costs at a key length not met before, against a repeat of
    the last one, with the default backends and with cuDNN's off (`rltt.rollout.kv_cache.without_cudnn_attention`,
    how the engine runs): the engine's attention shapes change every token (key length, entries, widths), so
    a backend that builds a plan per new shape pays it every pass. Batch 32, the model's heads, an additive
    mask as the engine's (`GroupedAttend`)."""
    import torch
    import torch.nn.functional as F

    from rltt.rollout.kv_cache import without_cudnn_attention

    cfg = model.config
    rows, heads, kv, dim = 32, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dtype = model.lm_head.weight.dtype
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    q = torch.randn(rows, kv, heads // kv, dim, generator=gen, device=ctx.device, dtype=dtype)
    setting = (f"{base}; one SDPA call of a decode pass: batch {rows}, {heads} query / {kv} KV heads, head dim {dim}, "
               f"additive mask; {calls} calls at key lengths not met before, then {calls} repeats of the last")
    sec.add("attention.cudnn_sdp_enabled_by_default", bool(torch.backends.cuda.cudnn_sdp_enabled()), "", setting)
    first_len = 4096  # longer than any key length the section meets before this sub-step
    for label, switch in (("default", None), ("cudnn_off", without_cudnn_attention)):
        new, again = [], []
        for i in range(2 * calls):
            key_len = first_len + min(i, calls - 1)
            keys = torch.randn(rows, kv, key_len, dim, generator=gen, device=ctx.device, dtype=dtype)
            mask = torch.zeros(rows, 1, heads // kv, key_len, device=ctx.device, dtype=dtype)
            ctx.sync()
            start = time.perf_counter()
            if switch is None:
                F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask)
            else:
                with switch():
                    F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask)
            ctx.sync()
            (new if i < calls else again).append(time.perf_counter() - start)
        first_len += calls
        sec.add(f"attention.{label}.new_shape_ms", round(1e3 * sum(new) / len(new), 3), "ms per call", setting)
        sec.add(f"attention.{label}.repeat_ms", round(1e3 * sum(again) / len(again), 3), "ms per call", setting)


def graphs_new_tokens(ctx: Context) -> int:
    """New tokens per row of the CUDA graphs comparison (and of the Triton attention's, at its batch)."""
    return max(3, ctx.shapes.new_tokens // 4)


def _kept(out) -> dict:
    """What the Triton attention's sub-step compares of an SDPA rollout, on the host (so the GPU copies can go)."""
    return {k: getattr(out, k).cpu() for k in ("completion_ids", "exit_steps", "logprobs", "completion_mask")}


def cuda_graphs_on_off(ctx: Context, sec: SectionResult, model, ids, base: str, deadline: Deadline,
                       kept: dict | None = None) -> None:
    """The native engine with its bucketed passes replayed as CUDA graphs (on CPU: the same bucketed passes
    run eagerly, `NativeEngine(buckets=True)`) and without: host work per pass (rltt.rollout.host_work:
    operators per (layer · pass), syncs and reads per pass), tokens/s, whether the outputs agree, replay
    of the graphs' rollout bitwise, and the bytes the buckets and the graph pool keep against the plan.
    ``kept``: filled with each schedule's "on" rollout (`_kept`) and its timed seconds, for `triton_attention`."""
    import torch

    from rltt.planning.graph_memory import engine_graphs_bytes
    from rltt.planning.shapes import ModelShape
    from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs
    from rltt.rollout.host_work import rollout_host_work

    bsz, new_tokens = ids.shape[0], graphs_new_tokens(ctx)
    on_label = "CUDA graphs" if ctx.cuda else "bucketed passes run eagerly (no CUDA)"
    setting = (f"{base}; batch {bsz}, prompt {ids.shape[1]}, {new_tokens} new tokens, greedy tokens, sampled exits; "
               f"on = {on_label}, off = unbucketed passes; one timed run each after a warm-up")
    off = NativeEngine(model, cuda_graphs=False)
    if ctx.cuda:  # the reserved bytes: the graphs' private pool keeps blocks its tensors freed
        torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved() if ctx.cuda else 0
    on = NativeEngine(model, cuda_graphs=True) if ctx.cuda else NativeEngine(model, buckets=True)

    def params(schedule, tokens=new_tokens, temperature=0.0, seed=1):
        return SamplingParams(temperature=temperature, max_new_tokens=tokens, exit_policy="sample",
                              schedule=schedule, seed=seed, ignore_eos=True)

    outs, times = {}, {}
    last = 0.0
    for schedule in ("dense", "deferred"):
        for name, engine in (("on", on), ("off", off)):
            if not deadline.allows(1.5 * last + 10 if ctx.cuda else 0):  # the section's later sub-steps need time too
                sec.skip(f"graphs {schedule} {name}")
                continue
            start = time.perf_counter()
            warm_s, _ = ctx.timed(lambda: engine.generate(ids.tolist(), params(schedule)))  # on: captures its buckets
            sec.log(f"graphs {schedule} {name}: warm-up {warm_s:.1f} s")
            t, outs[schedule, name] = ctx.timed(lambda: engine.generate(ids.tolist(), params(schedule)))
            times[schedule, name] = t
            if name == "on" and kept is not None:
                kept[schedule] = dict(_kept(outs[schedule, name]), seconds=t)
            sec.add(f"graphs.{schedule}.{name}.warmup_s", round(warm_s, 2), "s (first call: captures, new shapes)",
                    setting)
            sec.add(f"graphs.{schedule}.{name}.tok_s", round(bsz * new_tokens / t, 2), "tok/s", setting)
            _, work = rollout_host_work(engine, ids.tolist(), params(schedule), warmup=False)
            summary = work.summary()
            for key in ("operators_per_layer_pass", "launches_per_layer_pass", "syncs_per_pass", "reads_per_pass",
                        "uploads_per_pass"):
                sec.add(f"graphs.{schedule}.{name}.{key}", round(summary[key], 3), "", setting)
            last = time.perf_counter() - start
            sec.log(f"graphs {schedule} {name}: {last:.1f} s in all")
        if (schedule, "on") not in outs or (schedule, "off") not in outs:
            continue
        sec.add(f"graphs.{schedule}.on/off", ratio(times[schedule, "off"], times[schedule, "on"]), "x",
                setting + "; tokens/s on over off")
        a, b = outs[schedule, "on"], outs[schedule, "off"]
        sec.add(f"graphs.{schedule}.same_tokens_and_exits",
                bool(torch.equal(a.completion_ids.cpu(), b.completion_ids.cpu())
                     and torch.equal(a.exit_steps.cpu(), b.exit_steps.cpu())), "",
                setting + "; bitwise equal on CPU by construction, a wider GEMM may round otherwise on a GPU")
    sec.add("graphs.replayed_passes", on.buckets.replays, "passes", setting)
    sec.add("graphs.eager_bucketed_passes", on.buckets.eager, "passes", setting)
    sec.add("graphs.captures", on.buckets.captures, "(bucket, step kind) captures, L + 1 graphs each", setting)
    sampled = on.generate(ids.tolist(), params("deferred", temperature=1.0, seed=3))
    replayed = replay_logprobs(model, sampled)  # follows the engine that sampled: the same graphs
    sec.add("graphs.replay_bitwise_equal", bool(torch.equal(replayed.logprobs.cpu(), sampled.logprobs.cpu())
                                                and torch.equal(replayed.exit_logprobs.cpu(), sampled.exit_logprobs.cpu())),
            "", setting + "; a sampled deferred rollout with the graphs, replay_logprobs against it")
    shape = ModelShape.of(model.config)
    dtype_bytes = model.lm_head.weight.element_size()
    sizes = sorted(on.buckets.buckets)
    planned = engine_graphs_bytes(shape, dtype_bytes, capture=ctx.cuda, sizes=sizes)
    if ctx.cuda:
        del outs, sampled, replayed
        torch.cuda.empty_cache()
    measured = (torch.cuda.memory_reserved() - before) if ctx.cuda else on.buckets.nbytes()
    note = (f"{setting}; the buckets met ({sizes}): planned buffers (+ graph pool with CUDA) against "
            f"{'memory_reserved after the runs less before the engine, cache emptied' if ctx.cuda else 'their bytes'}")
    sec.add("graphs.planned_gib", round(planned / GIB, 4), "GiB", note)
    sec.add("graphs.measured_gib", round(measured / GIB, 4), "GiB", note)
    sec.add("graphs.planned/measured", ratio(planned, measured), "x", note)
    sec.add("graphs.captures_at_measurement", on.buckets.captures, "(bucket, step kind) captures",
            note + "; after the sampled deferred rollout and its replay (graphs.captures is read before them)")
    from rltt.rollout.buckets import attach

    attach(model, None)


#: new tokens of the batch sweep's profiled host-work call (the profiler slows each operator down)
HOST_WORK_TOKENS = 16


#: the time left the Triton attention's sub-step needs to start on the GPU (never measured there): one
#: schedule's warm-up (the kernel's compile, the engine's own graph captures), its timed run and its
#: host-work profile; the other schedule and the replay are guarded again inside
TRITON_ATTENTION_S = 25


def cuda_usable() -> bool:
    """Whether a tiny CUDA op and a synchronize still succeed (a failed kernel launch can poison the context)."""
    import torch

    try:
        (torch.ones(1, device="cuda") + 1).cpu()
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 - the answer
        return False


def triton_attention(ctx: Context, sec: SectionResult, model, ids, base: str, deadline: Deadline,
                     sdpa_on: dict) -> None:
    """``rollout.attention: triton`` (one `rltt.kernels.slot_attention` launch per layer over the cache
    slots read in place) with CUDA graphs on (on CPU: the bucketed passes run eagerly, the kernel under
    Triton's interpreter), at the CUDA graphs comparison's batch, prompts and length: per schedule
    (deferred first) tokens/s, its ratio to the graphs-on SDPA rollout of `cuda_graphs_on_off` (``sdpa_on``,
    same process, same prompts and parameters), host work per pass, and how many rows' tokens and exits
    equal SDPA's (with the log-probs' largest difference on those rows); then a sampled deferred rollout
    replayed bitwise with `replay_logprobs`."""
    import torch

    from rltt.rollout import NativeEngine, SamplingParams, replay_logprobs
    from rltt.rollout.buckets import attach
    from rltt.rollout.host_work import rollout_host_work

    bsz, new_tokens = ids.shape[0], graphs_new_tokens(ctx)
    on_label = ("CUDA graphs, each bucketed pass captured whole (one graph per bucket and step kind: every layer's "
                "KV write and slot attention inside it, not run eagerly between pieces as sdpa's are)" if ctx.cuda
                else "bucketed passes run eagerly (no CUDA), Triton's interpreter")
    setting = (f"{base}; rollout.attention triton, {on_label}; batch {bsz}, prompt {ids.shape[1]}, {new_tokens} "
               f"new tokens, greedy tokens, sampled exits; one timed run after a warm-up (the warm-up compiles "
               f"the kernel and captures this engine's graphs); the prompts and parameters of graphs.*.on")
    host_note = ("; host work: aten operators as for graphs.*.on (a graph's replay is not an aten operator: one "
                 "per replayed pass here, L + 1 there); Triton launches are not aten operators either, and with "
                 "the graphs they run inside the captured pass"
                 if ctx.cuda else "; host work: aten operators as for graphs.*.on — the slot-attention kernel "
                 "itself (one Triton launch per layer-pass) is not an aten operator and is not in these counts")
    if ctx.cuda:
        engine = NativeEngine(model, cuda_graphs=True, attention="triton")
    else:
        engine = NativeEngine(model, buckets=True, attention="triton")

    def params(schedule, temperature=0.0, seed=1):
        return SamplingParams(temperature=temperature, max_new_tokens=new_tokens, exit_policy="sample",
                              schedule=schedule, seed=seed, ignore_eos=True)

    times, last = {}, 0.0
    try:
        for schedule in ("deferred", "dense"):  # deferred first: the gap to dense is what the kernel is for
            if last and not deadline.allows(1.5 * last + 5 if ctx.cuda else 0):
                sec.skip(f"Triton attention {schedule}")
                continue
            start = time.perf_counter()
            warm_s, _ = ctx.timed(lambda: engine.generate(ids.tolist(), params(schedule)))
            sec.log(f"triton {schedule}: warm-up {warm_s:.1f} s")
            t, out = ctx.timed(lambda: engine.generate(ids.tolist(), params(schedule)))
            times[schedule] = t
            sec.add(f"triton.{schedule}.warmup_s", round(warm_s, 2), "s (first call: compile, captures, new shapes)",
                    setting)
            sec.add(f"triton.{schedule}.tok_s", round(bsz * new_tokens / t, 2), "tok/s", setting)
            sec.add(f"triton.{schedule}.recorded_attention", out.schedule.attention, "", setting)
            sdpa = sdpa_on.get(schedule)
            vs = setting + "; against graphs.%s.on (sdpa, same process)" % schedule
            sec.add(f"triton.{schedule}.triton/sdpa", ratio(sdpa["seconds"], t) if sdpa else None, "x",
                    vs + "; tokens/s with triton over with sdpa")
            if sdpa:
                got = _kept(out)
                same = ((got["completion_ids"] == sdpa["completion_ids"]).all(dim=1)
                        & (got["exit_steps"] == sdpa["exit_steps"]).all(dim=1))
                mask = got["completion_mask"] & sdpa["completion_mask"] & same[:, None]
                diff = (got["logprobs"] - sdpa["logprobs"]).abs()[mask]
                sec.add(f"triton.{schedule}.rows_equal_sdpa", int(same.sum()), f"rows of {bsz}",
                        vs + "; rows whose tokens and exit steps all equal sdpa's (tolerance, not bitwise: sums "
                        "in another order)")
                sec.add(f"triton.{schedule}.logprob_max_abs_diff_vs_sdpa",
                        float(diff.max()) if diff.numel() else None, "nats",
                        vs + "; largest |log-prob difference| over the completion tokens of the equal rows")
            del out
            _, work = rollout_host_work(engine, ids.tolist(), params(schedule), warmup=False)
            summary = work.summary()
            for key in ("operators_per_layer_pass", "launches_per_layer_pass", "syncs_per_pass", "reads_per_pass",
                        "uploads_per_pass"):
                sec.add(f"triton.{schedule}.{key}", round(summary[key], 3), "", setting + host_note)
            last = time.perf_counter() - start
            sec.log(f"triton {schedule}: {last:.1f} s in all")
        if "dense" in times and "deferred" in times:
            sec.add("triton.deferred/dense", ratio(times["dense"], times["deferred"]), "x",
                    setting + "; tokens/s deferred over dense, both with triton")
        sec.add("triton.captures", engine.buckets.captures, "(bucket, step kind) captures, one graph each (the "
                "whole pass)" if ctx.cuda else "(bucket, step kind) captures (none: no CUDA)", setting)
        sec.add("triton.graphs_held", sum(len(c.pieces) for b in engine.buckets.buckets.values()
                                          for c in b.graphs.values()), "graphs", setting)
        sec.add("triton.replayed_passes", engine.buckets.replays, "passes", setting)
        if not deadline.allows(8 if ctx.cuda else 0):  # a sampled rollout and its replay: about 1 + 2 s here
            sec.skip("Triton attention bitwise replay")
            return
        replay_setting = (setting + "; a sampled deferred rollout (temperature 1) with triton, replay_logprobs "
                          "against it (replay follows the recorded attention and this engine's graphs)")
        sampled = engine.generate(ids.tolist(), params("deferred", temperature=1.0, seed=3))
        t_replay, replayed = ctx.timed(lambda: replay_logprobs(model, sampled))
        got, want = replayed.logprobs.cpu(), sampled.logprobs.cpu()
        sec.add("triton.replay_bitwise_equal",
                bool(torch.equal(got, want)
                     and torch.equal(replayed.tempered_logprobs.cpu(), sampled.tempered_logprobs.cpu())
                     and torch.equal(replayed.exit_logprobs.cpu(), sampled.exit_logprobs.cpu())), "", replay_setting)
        sec.add("triton.replay_max_abs_diff", float((got - want).abs().max()), "nats", replay_setting)
        sec.add("triton.replay_s", round(t_replay, 3), "s", replay_setting)
    finally:
        attach(model, None)  # replay and later rollouts of this model no longer follow this engine's passes


# -- learner -------------------------------------------------------------------------------------------
def learner_batch(ctx: Context, vocab: int, num_loops: int):
    """G completions of random lengths per random prompt (rows share their prompt, as in RL)."""
    import torch

    from rltt.learner import LearnerBatch

    p = ctx.shapes.learner
    gen = torch.Generator().manual_seed(5)
    rows = p["prompts"] * p["group"]
    width = p["prompt_len"] + p["completion_len"]
    ids = torch.zeros(rows, width, dtype=torch.long)
    attn = torch.zeros(rows, width, dtype=torch.long)
    target = torch.zeros(rows, width, dtype=torch.bool)
    for i in range(p["prompts"]):
        prompt = torch.randint(1, vocab, (p["prompt_len"],), generator=gen)
        for j in range(p["group"]):
            r = i * p["group"] + j
            n = int(torch.randint(p["completion_len"] // 2, p["completion_len"] + 1, (), generator=gen))
            ids[r, : p["prompt_len"]] = prompt
            ids[r, p["prompt_len"]: p["prompt_len"] + n] = torch.randint(1, vocab, (n,), generator=gen)
            attn[r, : p["prompt_len"] + n] = 1
            target[r, p["prompt_len"]: p["prompt_len"] + n] = True
    exits = torch.where(target, torch.randint(1, num_loops + 1, (rows, width), generator=gen), torch.ones_like(ids))
    sampler = torch.where(target, -torch.rand(rows, width, generator=gen) * 5 - 5, torch.zeros(rows, width))
    adv = torch.randn(rows, generator=gen)
    return LearnerBatch(input_ids=ids, attention_mask=attn, target_mask=target, exit_steps=exits, advantages=adv,
                        sampler_logprobs=sampler, temperature=1.0)


def section_learner(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:

    from rltt.kernels import resolve_impl
    from rltt.learner import AlgorithmConfig, Learner, LearnerConfig
    from rltt.telemetry import schema

    model = ctx.ouro_model()
    p = ctx.shapes.learner
    batch = learner_batch(ctx, model.config.vocab_size, model.config.num_loops)
    cfg = LearnerConfig(backend="torch", dtype="bf16", lr=1e-6, micro_batch_size=p["micro"], pack_sequences=True)
    learner = Learner(model.train(), cfg, AlgorithmConfig(track_kl=False), batch_size=batch.size,
                      max_len=p["completion_len"])
    scored = int(batch.target_mask.sum())
    packed = p["prompts"] * p["prompt_len"] + int(batch.target_mask.sum())
    setting = (f"{model_setting(model)}; {p['prompts']} prompts x G={p['group']}, prompt {p['prompt_len']} + "
               f"completions {p['completion_len'] // 2}-{p['completion_len']} tokens, micro-batch {p['micro']}, packed "
               f"scoring, ppo_clip exit log-prob, torch AdamW bf16, log-prob kernel "
               f"{resolve_impl(None, learner.device)}; timed step after one warm-up step")
    t_first, _ = ctx.timed(lambda: learner.update(batch))
    sec.add("first_step_s", round(t_first, 3), "s (AdamW state allocation, compiles)", setting)
    if not deadline.allows(1.2 * t_first):
        sec.skip("timed learner step")
        return
    with PeakMemory(ctx) as mem:
        t_step, metrics = ctx.timed(lambda: learner.update(batch))
    sec.add("step_s", round(t_step, 3), "s", setting)
    sec.add("scored_tokens_per_s", round(scored / t_step, 1), f"tok/s ({scored} completion tokens)", setting)
    sec.add("packed_tokens_per_s", round(packed / t_step, 1), f"tok/s ({packed} packed tokens, each prompt once)",
            setting)
    sec.add("peak_memory_gib", mem.peak_gib, "GiB (weights, grads and AdamW states included)", setting)
    sec.add("loss_finite", bool(math.isfinite(metrics[schema.LOSS_TOTAL])), "", setting)
    model.eval()


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


# -- smoke: `rltt train` --------------------------------------------------------------------------------
def write_smoke_run(ctx: Context, tmp: Path) -> Path:
    """A small random LoopLM with a locally trained tokenizer, and a recipe on the GSM8K sample."""
    import torch
    import yaml

    from rltt.data import GSM8K_SAMPLE_DIR
    from rltt.data.gsm8k import load_gsm8k
    from rltt.data.tokenizer import train_tokenizer
    from rltt.model import LoopConfig, LoopedForCausalLM

    p = ctx.shapes.smoke
    records = load_gsm8k(GSM8K_SAMPLE_DIR, "train") + load_gsm8k(GSM8K_SAMPLE_DIR, "test")
    tok = train_tokenizer([r["question"] + "\n" + r["answer"] for r in records], vocab_size=128, kind="char")
    torch.manual_seed(0)
    config = LoopConfig(vocab_size=len(tok), hidden_size=p["hidden"], intermediate_size=2 * p["hidden"],
                        num_hidden_layers=p["layers"], num_attention_heads=p["heads"], num_loops=4,
                        max_position_embeddings=1024, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id)
    model = LoopedForCausalLM(config)
    from rltt.model.exits import gate_lambda

    lam = gate_lambda(MEAN_EXIT, config.num_loops)
    with torch.no_grad():
        model.model.exit_gate.weight.zero_()
        model.model.exit_gate.bias.fill_(math.log(lam / (1 - lam)))
    model.save_pretrained(tmp / "policy")
    tok.save_pretrained(tmp / "policy")
    recipe = {
        "model": {"path": str(tmp / "policy"), "dtype": p["dtype"], "device": ctx.device.type},
        "data": {"source": str(GSM8K_SAMPLE_DIR), "eval_size": p["eval_size"]},
        "rewards": [{"fn": "rewards/gsm8k.py:strict"}, {"fn": "rewards/format.py:format_reward", "weight": 0.1}],
        "rollout": {"prompts_per_step": p["prompts"], "group_size": p["group"], "max_new_tokens": p["new_tokens"],
                    "exit_policy": "sample", "schedule": "deferred"},
        "algorithm": {"track_kl": True},
        "learner": {"backend": "torch", "dtype": p["dtype"], "lr": 1e-4, "micro_batch_size": p["micro"]},
        "train": {"steps": 5, "eval_every": 5, "threads": p["threads"]},
        "logging": {"run_dir": str(tmp / "run"), "progress": False, "review_at_end": False},
        "checkpoint": {"every": 0, "save_final": True},
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def section_smoke(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    """``rltt train RECIPE`` through the CLI's entry point, in this process (deepspeed, ray and vllm
    stay unimportable; the section's alarm bounds it)."""
    from rltt.cli.main import main as rltt_main
    from rltt.telemetry import read_metrics, schema

    p = ctx.shapes.smoke
    with tempfile.TemporaryDirectory(prefix="rltt-gpu-check-") as name:
        tmp = Path(name)
        recipe = write_smoke_run(ctx, tmp)
        start = time.perf_counter()
        with engine_calls(sec) as calls:
            code = rltt_main(["train", str(recipe)])
        wall = time.perf_counter() - start
        if code:
            raise RuntimeError(f"rltt train {recipe.name} exited with {code} (its error is printed above)")
        records = read_metrics(tmp / "run")
        steps = [r for r in records if r["step"] > 0]
        final = tmp / "run" / "checkpoints"
        setting = (f"rltt train (the CLI, in-process) on {ctx.device.type}: random LoopLM d={p['hidden']}, "
                   f"L={p['layers']}, T=4, char tokenizer trained locally, GSM8K sample, {p['prompts']} prompts x "
                   f"G={p['group']}, {p['new_tokens']} new tokens, deferred + sampled exits, torch backend "
                   f"{p['dtype']}, track_kl, eval at steps 0 and 5, final checkpoint")

        def mean(key):
            values = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
            return round(sum(values) / len(values), 4) if values else None

        sec.add("steps_logged", len(steps), "steps", setting)
        sec.add("generate_calls", len(calls), "calls (training steps and evaluations)", setting)
        if calls:
            sec.add("generate_first_s", round(calls[0], 2), "s", setting)
            sec.add("generate_max_s", round(max(calls), 2), "s", setting)
        sec.add("wall_s", round(wall, 2), "s (model load, evaluations, checkpoint)", setting)
        sec.add("step_time_s_mean", mean(schema.TIME_STEP), "s", setting)
        sec.add("rollout_tok_s_mean", mean(schema.THROUGHPUT_TOKENS_PER_S), "tok/s", setting)
        sec.add("peak_memory_gb_max", max((r.get(schema.MEMORY_PEAK_GB) or 0 for r in steps), default=None), "GB", setting)
        sec.add("reward_mean", mean(schema.REWARD_MEAN), "", setting)
        sec.add("eval_solve_rate_final", steps[-1].get("eval/solve_rate") if steps else None, "", setting)
        sec.add("checkpoint_written", final.is_dir() and any(final.iterdir()), "", setting)
        if len(steps) != 5:
            raise RuntimeError(f"rltt train logged {len(steps)} steps, expected 5")


# -- DeepSpeed: the default GPU path ---------------------------------------------------------------------
def section_deepspeed(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    """bench/gpu_check_deepspeed.py in its own process (this one keeps DeepSpeed unimportable),
    given the section's time less its start-up; its figures, failures and skipped sub-steps are
    this section's. Its output goes to this log. Without DeepSpeed installed the section is
    ``absent`` with a note (the GPU image: carry bench/gpu_bundle.sh's wheels)."""
    worker = Path(__file__).with_name("gpu_check_deepspeed.py")
    held = 0
    if ctx.cuda:  # this process's share of the GPU (the worker's 80 GB card leaves it out)
        import torch

        ctx._model = None  # the Ouro-shaped model of the sections before (rebuilt by a later one)
        ctx.release()
        free, total = torch.cuda.mem_get_info(ctx.device)
        held = total - free
    with tempfile.TemporaryDirectory(prefix="rltt-gpu-check-ds-") as name:
        cmd = [sys.executable, str(worker), "--out", name, "--budget", f"{max(deadline.left() - 20, 1):.0f}",
               "--held-elsewhere", str(held)]
        cmd += ["--cpu-smoke"] if ctx.cpu_smoke else []
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=max(deadline.left() - 2, 1))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "killed at the section's budget"
        result_file = Path(name) / "deepspeed.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else None
    if result is None:
        raise RuntimeError(f"bench/gpu_check_deepspeed.py exited with {code} before writing its figures")
    if _take_worker_result(sec, "deepspeed", result) and code:
        sec.failures.append(f"bench/gpu_check_deepspeed.py exited with {code}")


def _take_worker_result(sec: SectionResult, section: str, result: dict) -> bool:
    """A section worker's result file as this section's: ``absent`` with its note (False), or its
    figures, failures and skipped sub-steps (True)."""
    if "absent" in result:
        sec.absent = result["absent"]
        print(f"[gpu_check] {section}: {sec.absent}", flush=True)
        return False
    for f in result["figures"]:
        sec.add(f["name"], f["value"], f["unit"], f["setting"])
    sec.failures += result["failures"]
    sec.skipped += result.get("skipped", [])
    return True


# -- vLLM ---------------------------------------------------------------------------------------------
def section_vllm(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    """bench/gpu_check_vllm.py in its own process (this one keeps vLLM unimportable); its figures
    are this section's. Without vLLM installed the section is ``absent`` with a note."""
    worker = Path(__file__).with_name("gpu_check_vllm.py")
    with tempfile.TemporaryDirectory(prefix="rltt-gpu-check-vllm-") as name:
        cmd = [sys.executable, str(worker), "--out", name] + (["--cpu-smoke"] if ctx.cpu_smoke else [])
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(deadline.left() - 5, 1))
        result_file = Path(name) / "vllm.json"
        if proc.returncode or not result_file.exists():
            raise RuntimeError(f"bench/gpu_check_vllm.py exited with {proc.returncode}: {proc.stderr[-1500:]}")
        result = json.loads(result_file.read_text())
    _take_worker_result(sec, "vllm", result)


# -- output -------------------------------------------------------------------------------------------
def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def markdown(report: dict) -> str:
    """The report as Markdown: a header (command, GPU, versions), one status row per section, then
    each section's figures, grouped under the setting they were measured in."""
    env = report["env"]
    gpu = env.get("gpu")
    if env.get("gpu_sms"):
        gpu += f" ({env['gpu_memory_gib']} GiB, compute capability {env['gpu_capability']}, {env['gpu_sms']} SMs)"
    lines = [f"# GPU check ({env['mode']})", "",
             f"Command: `{report['command']}`", "",
             f"- GPU: {gpu}",
             f"- torch {env['torch']} (CUDA {env['torch_cuda']}), triton {env['triton']}, transformers "
             f"{env['transformers']}, tokenizers {env['tokenizers']}, Python {env['python']}",
             f"- rltt {env['rltt_commit']}; Triton interpreter: {env['triton_interpret'] or 'off'}; "
             f"deepspeed/ray/vllm modules loaded: {len(env.get('heavy_modules_loaded', []))}",
             f"- total {report['total_s']:.1f} s", "",
             "| section | status | seconds | budget s | error / skipped |", "|---|---|---:|---:|---|"]
    for sec in report["sections"].values():
        note = (sec["error"] or "; ".join(f"skipped: {s}" for s in sec["skipped"]) or sec.get("absent") or ""
                ).replace("|", "/")
        lines.append(f"| {sec['name']} | {sec['status']} | {sec['seconds']:.1f} | {sec['budget_s']:.0f} | {note} |")
    for sec in report["sections"].values():
        lines += ["", f"## {sec['name']}"]
        setting = None
        for f in sec["figures"]:
            if f["setting"] != setting:
                setting = f["setting"]
                lines += ["", f"Setting: {setting}", "", "| figure | value | unit |", "|---|---:|---|"]
            lines.append(f"| {f['name']} | {_fmt(f['value'])} | {f['unit'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


# -- main ---------------------------------------------------------------------------------------------
FUNCS = dict(imports=section_imports, kernels=section_kernels, rollouts=section_rollouts, learner=section_learner,
             plan=section_plan, deepspeed=section_deepspeed, vllm=section_vllm, smoke=section_smoke)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the same code paths at the smallest shapes on CPU (Triton under its interpreter)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time budget")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        parser.error(f"--sections: unknown section {bad[0]!r} (choose from {', '.join(SECTIONS)})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # the kernels must compile for the GPU
    block_heavy_modules()
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu-smoke on a machine without one)", file=sys.stderr)
        return 2
    if args.cpu_smoke:
        torch.set_num_threads(1)  # tiny shapes: OpenMP threads only stall on shared cores
    ctx = Context(args.cpu_smoke, args.budget_scale)
    report = dict(command="python bench/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  env=environment(ctx), sections={}, total_s=0.0)
    signal.signal(signal.SIGTERM, on_sigterm)  # the outer `timeout`: write what was measured, then exit
    for name in args.sections:
        try:
            result = run_section(name, FUNCS[name], ctx)
        except Terminated:
            report["sections"][name] = asdict(ctx.running) if ctx.running is not None else {}
            for later in args.sections[args.sections.index(name) + 1:]:
                report["sections"][later] = asdict(SectionResult(later, 0.0, status="not run (SIGTERM)"))
            report["total_s"] = round(time.perf_counter() - started, 2)
            write_outputs(report, args.out)
            log("terminated by SIGTERM: the JSON and Markdown hold what was measured")
            return 143
        report["sections"][name] = asdict(result)
        report["total_s"] = round(time.perf_counter() - started, 2)
        write_outputs(report, args.out)  # after every section: a killed run still leaves its figures
    report["env"]["heavy_modules_loaded"] = sorted(
        m for m in sys.modules if m.split(".")[0] in HEAVY and sys.modules[m] is not None)
    report["total_s"] = round(time.perf_counter() - started, 2)
    write_outputs(report, args.out)
    print(markdown(report))
    return 0 if all(s["status"] in ("ok", "absent") for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
