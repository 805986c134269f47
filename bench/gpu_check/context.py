"""What every section shares: the shapes of the GPU run and of the CPU smoke, the run's context (device,
timing, the Ouro-shaped model), the environment, memory meters and the logged engine calls."""

from __future__ import annotations

import gc
import importlib
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .report import GIB, SectionResult

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("deepspeed", "ray", "vllm")

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
    engine: dict  # batch, other_attention, batches, prompt_len, new_tokens, calls, generate_batch,
    # continuous_batches: the engine section

    @staticmethod
    def gpu() -> "Shapes":
        return Shapes(
            # from the H200's second run (bench/gpu_runs/2026-12-04b/full.log, at 3c0d387, cuDNN attention off):
            # imports 9.6 s, kernels 38 s (its N = 1024 timing skipped), learner 19 s (its timed step
            # skipped: the first step took 19 s), plan 47 s, deepspeed 112 s (card141 skipped: 120 s
            # estimated), smoke 18 s; rollouts ran out at 148 s, in the batch sweep's first batch size, and a
            # rerun with 364 s reached the same point (the sweep's host-work profile at 128 tokens). So
            # rerun with 364 s reached the same point (the sweep's host-work profile at 128 tokens). The batch
            # sweep and generate() moved to the engine section (which runs first, alone within 240 s: one device
            # call); rollouts keeps the attention cost, the graphs on/off comparison with its host work, the
            # Triton attention (26-30 s measured there) and the replay: 120 s. Two device calls: engine,imports,
            # rollouts (372 s) and kernels,learner,plan,deepspeed,vllm,smoke (345 s; vLLM absent on the image)
            budgets=dict(engine=240, imports=12, kernels=50, rollouts=120, learner=45, plan=55, deepspeed=160,
                         vllm=150, smoke=35),
            kernel_checks=[(3, 37, 200, 1001, 1.0, False), (2, 130, 72, 32003, 0.7, True),
                           (4, 5, 2048, 151936, 1.0, False), (1, 1, 64, 64, 1.3, False)],
            kernel_times=[(4, 8192, 2048, 151936), (4, 1024, 2048, 151936)], kernel_reps=3,
            model=OURO_1_4B, batches=[1, 8, 32, 256], new_tokens=128, prompt_len=32, generate_batch=32,
            replay_batch=8, graphs_batch=32,
            learner=dict(prompts=8, group=8, prompt_len=128, completion_len=384, micro=8),
            plan=dict(prompts=4, group=8, prompt_len=64, new_tokens=128, micro=8),
            smoke=dict(hidden=128, layers=2, heads=4, prompts=8, group=8, new_tokens=64, eval_size=32,
                       micro=16, dtype="bf16", threads=0),
            engine=dict(batch=32, other_attention="triton", batches=[1, 8, 32, 128, 256], prompt_len=32,
                        new_tokens=32, calls=3, generate_batch=32, continuous_batches=[32, 128, 256]))

    @staticmethod
    def cpu_smoke() -> "Shapes":
        small = dict(OURO_1_4B, vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
        return Shapes(
            budgets=dict(engine=150, imports=30, kernels=60, rollouts=60, learner=40, plan=50, deepspeed=300,
                         vllm=240, smoke=90),
            kernel_checks=[(3, 7, 24, 101, 1.0, False), (2, 6, 16, 70, 0.7, True)],
            kernel_times=[(2, 8, 16, 128), (2, 4, 16, 128)], kernel_reps=1,
            model=small, batches=[1, 2], new_tokens=3, prompt_len=4, generate_batch=2, replay_batch=2, graphs_batch=4,
            learner=dict(prompts=1, group=2, prompt_len=4, completion_len=4, micro=2),
            plan=dict(prompts=2, group=2, prompt_len=6, new_tokens=4, micro=2),
            smoke=dict(hidden=16, layers=1, heads=2, prompts=1, group=2, new_tokens=4, eval_size=2,
                       micro=2, dtype="fp32", threads=1),
            engine=dict(batch=4, other_attention="triton", batches=[1, 2, 4, 8, 16], prompt_len=4, new_tokens=3,
                        calls=3, generate_batch=4, continuous_batches=[4]))


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

    def reset_peak(self) -> None:
        """Reset the allocator's peak (CUDA): a peak read later is this point's or after."""
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)

    def timed_calls(self, fn, calls: int) -> tuple[list[float], object]:
        """``calls`` timed calls of ``fn`` (warmed up by the caller): each one's seconds, and the last output."""
        times, out = [], None
        for _ in range(calls):
            out = None  # the last call's output is freed before the next one runs
            seconds, out = self.timed(fn)
            times.append(seconds)
        return times, out

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


def spread(times: list[float]) -> tuple[float, float]:
    """(min, median) of a sub-step's timed calls."""
    return min(times), statistics.median(times)


def ratio(a, b):
    return round(a / b, 4) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None



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
