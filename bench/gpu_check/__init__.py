"""One prepared GPU check: the rollout engine against the roofline, Triton kernels, rollouts, the learner,
DeepSpeed and ``rltt train`` on one GPU. A package, one module per section (``engine``, ``imports``,
``kernels``, ``rollouts``, ``learner``, ``plan``, ``deepspeed_run``, ``vllm_run``, ``smoke``), what they share
in ``context`` (shapes, the run's context, meters, the Ouro-shaped model) and ``report`` (figures, budgets,
guards, JSON and Markdown), the command line in ``cli``.

Device commands (one H200 or H100 with the image's torch 2.11.0+cu130, triton 3.6.0 and transformers
5.17.0, from the repository root, after ``bash bench/gpu_bundle.sh`` here: the device tool carries
``.gpu_bundle``, the DeepSpeed wheels the image lacks; each writes ``$OUT/gpu_check.json``,
``$OUT/gpu_check.md`` and the log). The engine section first, alone in one short call (240 s budget,
run-tool timeout 300 s):

    export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 && set -o pipefail && timeout 280 python3 bench/gpu_check --sections engine --out $OUT 2>&1 | tee $OUT/gpu_check.log

then the rest in two calls (budgets 132 s and 345 s without vLLM's, whose section is "absent" in a second on the image;
run-tool timeouts 200 s and 540 s; the three budgets sum to 717 s without vLLM's):

    ... && timeout 180 python3 bench/gpu_check --sections imports,rollouts --out $OUT 2>&1 | tee $OUT/gpu_check.log
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu_bundle/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && set -o pipefail && timeout 520 python3 bench/gpu_check --sections kernels,learner,plan,deepspeed,vllm,smoke --out $OUT 2>&1 | tee $OUT/gpu_check.log

The JSON and Markdown are rewritten after every section, and on SIGTERM (the outer ``timeout``) with
the running section's figures, so a run stopped early keeps what it measured; the log has every
sub-step's start and elapsed time. A rerun of some sections only: ``--sections kernels,learner``. CPU mode (the same code
paths at the smallest shapes, in seconds; ``tests/bench/test_gpu_check.py`` runs it):

    python bench/gpu_check --cpu-smoke --out /tmp/gpu_check     # or: rltt bench gpu_check --cpu-smoke ...

Sections (each guarded: a failure, of the section or of one sub-step, is recorded with its error
text and the rest still runs; each has a time budget: a sub-step the time left cannot cover is
skipped and recorded as skipped, and an alarm ends the section at its budget; the allocator's peak is
reset before each section):

- ``engine`` (first): the native engine on the Ouro-shaped model of ``rollouts`` below against the
  device's roofline (`rltt.planning.roofline`): with ``rollout.cuda_graphs`` dense and deferred at batch
  32 with the default attention (sdpa) and the other (triton, each pass captured whole); the batch sweep
  1 / 8 / 32 / 128 / 256; native final exits against ``generate()`` at batch 32; the graph memory against
  the plan; each setting warmed up by one call, then 3 timed calls reported as fastest and median, with
  the bound and the fraction reached (`bench/gpu_check/engine.py`);
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
  one SDPA call's cost at new key lengths (each call's time, the process's first call apart: it pays
  one-time set-up) against repeats, default backends and cuDNN's off (the engine's setting); the native engine with ``rollout.cuda_graphs`` on and off at batch 32 (host
  work per pass — operators per layer-pass, syncs and reads per pass —, tokens/s, replay bitwise
  with the graphs, the buckets' and graph pool's bytes against the plan; on CPU "on" is the same
  bucketed passes run eagerly); ``rollout.attention: triton`` with the graphs on at that batch and
  length, each bucketed pass captured whole (one graph per bucket and step kind, the KV writes and
  the slot attention inside it; 35 s needed to start, it took 26-30 s on the H200): tokens/s of deferred and dense and their ratio to the SDPA figures just measured, host work
  per pass, rows whose tokens and exits equal SDPA's and the log-probs' largest difference on
  them, and a sampled deferred rollout's
  ``replay_logprobs`` bitwise, a compile or launch error recorded as that sub-step's failure (with
  whether CUDA still works after it); ``replay_logprobs`` bitwise against a sampled deferred
  rollout; the host work per pass of dense and deferred at batch 1 (16 new tokens, profiled); every
  tokens/s figure the fastest and the median of 3 timed calls after a warm-up call;
- ``learner``: one RL learner step (packed scoring, backward, AdamW) on that model, after a
  warm-up step (which bounds the timed step's time: the guard's estimate): tokens per second and peak memory;
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
(recorded, not asserted): on Ouro-1.4B's shape at batch 32 dense >= 40 % and deferred >= 35 % of the
bound, >= 50 % at batch 256; deferred >= 1.4x dense tokens/s at batch >= 8; native >= 5x ``generate()``
at batch 32; the Triton kernel <= 1/20 of the naive peak memory and <= 1x its time;
the memory plan within 15 % of the measured phase peaks; DeepSpeed's accumulated gradient within
one bf16 rounding of the fp32 sum.
"""

from .context import (GIB, HEAVY, MEAN_EXIT, OURO_1_4B, ROOT, Context, PeakMemory, Shapes, block_heavy_modules,
                      build_ouro_model, engine_calls, environment, model_setting, ratio, spread)
from .report import (Deadline, Figure, SectionResult, SectionTimeout, Terminated, alarm, log, markdown, on_sigterm,
                     run_section, take_worker_result, write_outputs)
from .cli import FUNCS, SECTIONS, main, parse_args  # noqa: E402 - after what its modules import
from .deepspeed_run import section_deepspeed
from .engine import section_engine
from .imports import section_imports
from .kernels import kernel_checks, kernel_times, section_kernels
from .learner import learner_batch, section_learner
from .plan import measure_phase, section_plan
from .rollouts import (HOST_WORK_TOKENS, TRITON_ATTENTION_S, attention_shape_cost, cuda_graphs_on_off, cuda_usable,
                       section_rollouts, triton_attention)
from .smoke import section_smoke, write_smoke_run
from .vllm_run import section_vllm

# what tests reach through the package (``gc.subprocess.run`` patched, ``gc.asdict``)
import subprocess  # noqa: E402
from dataclasses import asdict  # noqa: E402

__all__ = ["FUNCS", "GIB", "HEAVY", "HOST_WORK_TOKENS", "MEAN_EXIT", "OURO_1_4B", "ROOT", "SECTIONS",
           "TRITON_ATTENTION_S", "Context", "Deadline", "Figure", "PeakMemory", "SectionResult", "SectionTimeout",
           "Shapes", "Terminated", "alarm", "asdict", "attention_shape_cost", "block_heavy_modules",
           "build_ouro_model", "cuda_graphs_on_off", "cuda_usable", "engine_calls", "environment", "kernel_checks",
           "kernel_times", "learner_batch", "log", "main", "markdown", "measure_phase", "model_setting",
           "on_sigterm", "parse_args", "ratio", "run_section", "section_deepspeed", "section_engine",
           "section_imports", "section_kernels", "section_learner", "section_plan", "section_rollouts",
           "section_smoke", "section_vllm", "spread", "subprocess", "take_worker_result", "triton_attention",
           "write_outputs", "write_smoke_run"]
