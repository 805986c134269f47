"""Rollout engine throughput: dense vs deferred schedules, and native vs transformers' generate().

    python bench/rollout.py                      # full run (< 8 min on 2 CPU cores)
    python bench/rollout.py --write              # … and update bench/RESULTS.md's section (its text up to
                                                 # the first ### subsection; the subsections are kept)
    python bench/rollout.py --group 8            # RL-shaped batches: G = 8 rows per prompt
    python bench/rollout.py --engine vllm --batch-sizes 1,8,32,256 --group 8 --clock wall
                                                 # vLLM vs native dense and deferred
    python bench/rollout.py --host-work --hidden 128 --layers 2 --batch-sizes 8 --new-tokens 24 --write
                                                 # … and the host work per pass (profiler counts,
                                                 # rltt.rollout.host_work) of dense and deferred
    python bench/rollout.py --gemm-floor --new-tokens 64 --mean-exit 2.2 --temperature 1.0 --write
                                                 # … and how far dense could go past generate() if all
                                                 # its work but the GEMMs (and attention) cost nothing
    python bench/rollout.py --buckets --batch-sizes 1,8,32 --write
                                                 # bucketed passes (rltt.rollout.buckets, run eagerly: the
                                                 # CPU form of the CUDA-graph path) against today's passes
    python bench/rollout.py --passes --batch-sizes 1,8,32,128 --write
                                                 # serial passes per new token against E[t*] (counts only,
                                                 # no timing): where deferred's passes go at a batch
    python bench/rollout.py --device cuda --batch-sizes 1,8,32,256 --clock wall
                                                 # on a GPU (bf16): every tok/s with its roofline bound
                                                 # and the fraction reached (rltt.planning.roofline; the
                                                 # device's figures by its name, or --roofline NAME)

The model is random (d=512, L=4, T=4, GQA 8/2 heads, V=4096) with the exit gate's weight
zeroed and its bias set so every gate probability is λ, chosen so that E[t*] = 2.5 under the
``sample`` exit policy (E[t*] = Σ_{t<T} (1 − λ)^t). Decoding is greedy (tokens) with sampled
exits; the engine draws each token's exit from a counter-based uniform keyed by the row and the
token's index (``rltt.rollout.sampler.RowRandom``), not by the order of the passes, so dense and
deferred make exactly the same exits (checked). Each configuration runs ``--repeats`` times,
interleaved, and the fastest run is reported.

Timing: the development machine is shared (other jobs keep its 2 cores busy), which makes
wall-clock figures swing by 2-10x between runs and makes multi-threaded OpenMP regions stall.
So the default is one intra-op thread and the throughput is tokens per second of *process
CPU time* (``time.process_time``), which other jobs do not inflate; wall-clock figures are
printed too. Pass ``--clock wall`` (and ``--threads N``) on a dedicated machine.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

import torch

from rltt.model import LoopConfig, LoopedForCausalLM
from rltt.model.exits import gate_lambda
from rltt.rollout import NativeEngine, SamplingParams
from rltt.planning.roofline import RolloutWork, device_spec, rollout_roofline
from rltt.planning.shapes import ModelShape
from rltt.rollout.host_work import rollout_host_work

SECTION = "## Rollout engine (bench/rollout.py)"
VLLM_SECTION = "### vLLM engine (`bench/rollout.py --engine vllm`)"
HOST_SECTION = "### Host work per pass (`bench/rollout.py --host-work`)"
BUCKET_SECTION = "### Bucketed passes (`bench/rollout.py --buckets`)"
PASSES_SECTION = "### Serial passes per token against E[t*] (`bench/rollout.py --passes`)"
PASSES_NOTES = """\
Counts, not times: one deferred call per (batch, new tokens), greedy tokens with sampled exits (gate bias for
the E[t*] asked), one row per prompt (its prompt's entries ride along in its first token's passes: no passes
of their own, *other passes* = 0). *Serial passes per token* = the call's passes / new tokens per row: what a
batch costs where a pass costs the same whatever it holds (memory-bound decode on a GPU). *Row passes per
token*: the passes each row took part in / its tokens, averaged — the schedule's own cost per token, E[t*]. A
batch runs until its slowest row is done, so its passes are the largest Σ t* over its rows (plus a shared
prefill's T passes where G > 1); the *slowest row* column is that row's Σ t* / N. The gap
between serial passes and E[t*] is that maximum, and it grows with the rows (more draws to take the maximum
of) and shrinks with the new tokens (the sum concentrates): no pass order inside a batch removes it, since
every row's tokens need their own t* passes one after another. Rows of the next prompts taking the slots of
finished rows (continuous batching) would. The counts do not depend on the model's width: the gate's weight is
zeroed, so every exit is a draw against the same λ from the row's counter-based uniforms.
"""
FLOOR_SECTION = "### The GEMM floor: native dense against generate() (`bench/rollout.py --gemm-floor`)"
FLOOR_NOTES = """\
Native dense and `generate()` with final exits run the same GEMMs per token (every token computes all T
loop steps). One more call of each runs under `torch.profiler` (CPU activity) and the self time of its GEMM
operators (`aten::mm`, `addmm`, `bmm`, `baddbmm`, `mv`, `addmv`) and of its attention kernels (the
`scaled_dot_product` operators) is summed. *GEMM bound* = generate()'s (unprofiled) time / dense's GEMM time:
the most dense/generate() could reach if everything in a native pass but its GEMMs took no time; *GEMM +
attention bound* leaves the attention kernels in as well. The profiler inflates small operators more than
GEMMs, which lowers the measured GEMM share and so raises these bounds: they are upper bounds.
"""
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv"})
BUCKET_NOTES = """\
Bucketed passes (`rltt.rollout.buckets`, docs/engine.md) pad a pass's items to a table of sizes so that a
GPU can replay each bucket's pieces as CUDA graphs; on CPU the same bucketed code runs eagerly, which costs
the padded rows' arithmetic and a few copies per pass and saves nothing (there is no launch cost to save).
The columns: tokens per CPU second of the unbucketed and the bucketed engine in the same process (best of
the repeats, interleaved), their ratio, the share of passes run through a bucket (padded, or already at a
bucket size), and whether every output (tokens, exits, log-probs, gates, pass record) was bitwise equal
(checked on every run).
"""
HOST_NOTES = """\
Counted by `rltt.rollout.host_work.profile_host_work` (torch.profiler, CPU activity) over one
`NativeEngine.generate` call after a warm-up, prefill included: *operators* are top-level `aten::`
operators (what the host dispatches, views included), *launches* the same less the ops that launch no
kernel (views, `detach`, `lift_fresh`, `empty`, …), *syncs* the `aten::_local_scalar_dense`
(`.item()`, `bool(t)`, `int(t)`), `aten::nonzero` and `aten::masked_select` calls at any depth, and
*host tensors* the `torch.tensor(python data)` calls (`aten::lift_fresh`; on a GPU each is a
host-to-device copy). *Made in a pass (uploaded)*: `torch.tensor` / `torch.as_tensor` calls on Python
data during the engine's passes, and how many of them it uploads to its device; *reads per pass (max)*:
`.tolist()` / `.cpu()` / `.item()` / `bool()` calls during a pass (`rltt.rollout.host_work.ReadCounter`,
counted on CPU too; on a GPU each is a device-to-host transfer), the mean and the most in one pass.
Counts do not depend on the model's width.
"""

NOTES = """\
Reading the figures (targets: deferred >= 1.5x dense at E[t*] ~ 2.5/4; native >= 2x generate() at batch 32;
the ratios are the bold columns of the tables):

- Deferred cuts serial passes per token exactly as the exits predict (T -> E[t*]; column 6). At
  batch 1, where a pass costs about the same whatever it holds (weight reads + per-op
  overhead), throughput follows the pass count, short of the ideal (column 6's ratio) by the
  pending work riding along. The 1.5x target is missed at batch >= 8.
- At batch 8-64 pass time grows with the (token, step) entries it holds, and deferred computes
  almost the same entries as dense (column 7: a deeper later token needs the pending entries of
  earlier ones; only the tail stays pending). On the d=512 model one core is compute-bound in
  the GEMMs, so deferred gains less than at batch 1; on the tiny model (d=128, L=2) the small
  ops of the multi-token entries cost more than the passes saved, and deferred is slower than
  dense. The gain reported for GPUs (ScaleRLT's 1.56x) needs passes whose cost does not grow
  with the pending entries riding along: memory-bound decode on a GPU. Not measured on a GPU
  (none was available).
- Native vs generate() with final exits run identical FLOPs per token. With one prompt per row
  native is slower than generate() at small batches and at best on par at batch 32:
  generate()'s one forward per token has less per-pass overhead than native's T passes. In RL-shaped batches (G = 8 rows per prompt, `--group 8`) native
  computes each prompt once and forks its KV state to the G rows, and is faster than
  generate() on d=512 (prompt 16 tokens, 32 new; the share grows with the prompt length);
  on the tiny model the per-pass overhead weighs more and the fork gains less. The 2x target is
  missed on CPU.
- Since the first version of these tables: one attention call per pass for all single-token
  entries (not one per step group), a dense token's T passes reuse one pass plan, counter-based
  vectorised sampling, shared prompt prefill.
"""




def build_model(args) -> LoopedForCausalLM:
    torch.manual_seed(0)
    cfg = LoopConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                     num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                     num_loops=args.loops, max_position_embeddings=1024)
    model = LoopedForCausalLM(cfg).eval()
    lam = gate_lambda(args.mean_exit, args.loops)
    with torch.no_grad():
        model.model.exit_gate.weight.zero_()
        model.model.exit_gate.bias.fill_(math.log(lam / (1 - lam)))
    if getattr(args, "device", "cpu") == "cuda":
        model = model.to("cuda", torch.bfloat16)
    return model


def timed(fn, clock):
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    start = clock()
    out = fn()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return clock() - start, out


def roofline_spec(args):
    """The device figures the bounds use: ``--roofline NAME``, else the CUDA device's by its name; None on CPU."""
    if getattr(args, "roofline", None):
        spec = device_spec(args.roofline)
        if spec is None:
            raise SystemExit(f"--roofline: no figures for {args.roofline!r} (rltt.planning.roofline.DEVICES)")
        return spec
    if getattr(args, "device", "cpu") == "cuda":
        return device_spec(torch.cuda.get_device_name())
    return None


def bound_fraction(model, out, seconds: float, args, spec) -> tuple[float, float] | None:
    """(bound tok/s, fraction reached) of one call's work on ``spec`` (None without figures)."""
    if spec is None:
        return None
    work = RolloutWork.of(out.stats, args.prompt_len, args.new_tokens)
    bound = rollout_roofline(ModelShape.of(model.config), model.lm_head.weight.element_size(), work, spec)
    return bound.tokens_per_s, bound.fraction(seconds)


def run(args) -> tuple[list[dict], str]:
    torch.set_num_threads(args.threads)
    model = build_model(args)
    engine = NativeEngine(model)
    spec = roofline_spec(args)
    rows = []
    for bsz in args.batch_sizes:
        gen = torch.Generator().manual_seed(bsz)
        group = args.group if bsz % args.group == 0 else 1
        distinct = torch.randint(1, args.vocab, (bsz // group, args.prompt_len), generator=gen)
        prompts = distinct.repeat_interleave(group, 0).to(model.lm_head.weight.device)  # the rows generate() gets

        def native(schedule, policy):
            return engine.generate(distinct.tolist(), SamplingParams(
                temperature=args.temperature, max_new_tokens=args.new_tokens, exit_policy=policy, schedule=schedule, seed=1,
                ignore_eos=True, n=group))

        def hf():
            with torch.no_grad():
                sampling = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0) \
                    if args.temperature else dict(do_sample=False)
                return model.generate(prompts, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                      pad_token_id=0, **sampling)

        configs = {"dense": lambda: native("dense", "sample"), "deferred": lambda: native("deferred", "sample"),
                   "native_final": lambda: native("deferred", "final"), "hf_final": hf}
        native("deferred", "sample")  # warm-up
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        best, outs = {k: float("inf") for k in configs}, {}
        for _ in range(args.repeats):
            for name, fn in configs.items():
                seconds, outs[name] = timed(fn, clock)
                best[name] = min(best[name], seconds)
        dense, deferred = outs["dense"], outs["deferred"]
        assert torch.equal(dense.exit_steps, deferred.exit_steps), "dense and deferred made different exits"
        assert args.temperature or args.device == "cuda" or torch.equal(
            outs["native_final"].completion_ids, outs["hf_final"][:, args.prompt_len:].cpu()), \
            "native final-exit tokens differ from generate()"  # (bf16 on a GPU may split greedy paths)
        tokens = bsz * args.new_tokens
        row = dict(
            batch=bsz, group=group, mean_exit=float(deferred.exit_steps.float().mean()),
            dense_tps=tokens / best["dense"], deferred_tps=tokens / best["deferred"],
            native_final_tps=tokens / best["native_final"], hf_tps=tokens / best["hf_final"],
            dense_ppt=dense.stats.passes_per_token, deferred_ppt=deferred.stats.passes_per_token,
            dense_entries=dense.stats.entries_computed, deferred_entries=deferred.stats.entries_computed,
            pending=deferred.stats.entries_pending,
            dense_serial=dense.stats.passes / args.new_tokens, deferred_serial=deferred.stats.passes / args.new_tokens,
        )
        for name in ("dense", "deferred"):
            got = bound_fraction(model, outs[name], best[name], args, spec)
            if got is not None:
                row[f"{name}_bound"], row[f"{name}_fraction"] = got
        row["ratio"] = row["deferred_tps"] / row["dense_tps"]
        row["vs_hf"] = row["native_final_tps"] / row["hf_tps"]
        row["dense_vs_hf"], row["deferred_vs_hf"] = row["dense_tps"] / row["hf_tps"], row["deferred_tps"] / row["hf_tps"]
        if args.gemm_floor:
            row.update(gemm_floor(configs["dense"], hf, best["dense"], best["hf_final"]))
        if args.host_work:
            for schedule in ("dense", "deferred"):
                counted, work = rollout_host_work(engine, distinct.tolist(), SamplingParams(
                    temperature=0, max_new_tokens=args.new_tokens, exit_policy="sample", schedule=schedule, seed=1,
                    ignore_eos=True, n=group), warmup=False)
                assert torch.equal(counted.completion_ids, outs[schedule].completion_ids)
                row[f"{schedule}_host"] = work.summary()
        rows.append(row)
        print(f"batch {bsz}: dense {row['dense_tps']:.1f} tok/s, deferred {row['deferred_tps']:.1f} tok/s "
              f"({row['ratio']:.2f}x), native final {row['native_final_tps']:.1f} vs generate() "
              f"{row['hf_tps']:.1f} tok/s ({row['vs_hf']:.2f}x); dense / generate() {row['dense_vs_hf']:.2f}x, "
              f"deferred / generate() {row['deferred_vs_hf']:.2f}x", flush=True)
    md = table(rows)
    if spec is not None:
        md += "\n\n" + roofline_table(rows, spec)
    return rows, md


def roofline_table(rows: list[dict], spec) -> str:
    """Each tok/s figure of the main table with its bound on ``spec`` and the fraction reached."""
    lines = [f"Roofline: {spec.name} ({spec.bandwidth / 1e12:.3g} TB/s, {spec.bf16_flops / 1e12:.0f} bf16 TFLOP/s dense; "
             f"rltt.planning.roofline over each call's measured passes and entries)", "",
             "| batch (prompts × G) | dense tok/s | bound | fraction | deferred tok/s | bound | fraction |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} ({r['batch'] // r['group']} × {r['group']}) | {r['dense_tps']:.1f} | "
                     f"{r['dense_bound']:.0f} | **{r['dense_fraction']:.1%}** | {r['deferred_tps']:.1f} | "
                     f"{r['deferred_bound']:.0f} | **{r['deferred_fraction']:.1%}** |")
    return "\n".join(lines)


def run_passes(args) -> tuple[list[dict], str]:
    """Serial passes per new token of the deferred schedule against E[t*], per batch size and new-token count
    (``--passes-tokens``): counts of one call each, no timing."""
    torch.set_num_threads(args.threads)
    model = build_model(args)
    engine = NativeEngine(model)
    rows = []
    for new_tokens in args.passes_tokens:
        for bsz in args.batch_sizes:
            gen = torch.Generator().manual_seed(bsz)
            prompts = torch.randint(1, args.vocab, (bsz, args.prompt_len), generator=gen).tolist()
            out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new_tokens,
                                                          exit_policy="sample", schedule="deferred", seed=1,
                                                          ignore_eos=True))
            exits = out.exit_steps[out.completion_mask].float()
            row_sums = (out.exit_steps * out.completion_mask).sum(dim=1)
            mean_exit = float(exits.mean())
            row = dict(batch=bsz, new_tokens=new_tokens, mean_exit=mean_exit, passes=out.stats.passes,
                       serial=out.stats.passes / new_tokens, row_ppt=out.stats.passes_per_token,
                       slowest=float(row_sums.max()) / new_tokens,
                       prefill=(out.stats.passes - int(row_sums.max())) / new_tokens)
            row["over"] = row["serial"] / mean_exit
            rows.append(row)
            print(f"batch {bsz}, {new_tokens} tokens: E[t*] {mean_exit:.3f}, serial passes/token {row['serial']:.3f} "
                  f"({row['over']:.3f}x), row passes/token {row['row_ppt']:.3f}", flush=True)
    lines = ["| batch | new tokens | E[t*] (sampled) | row passes/token | slowest row Σt*/N | other passes/N "
             "| serial passes/token | serial / E[t*] |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['new_tokens']} | {r['mean_exit']:.3f} | {r['row_ppt']:.3f} | "
                     f"{r['slowest']:.3f} | {r['prefill']:.3f} | {r['serial']:.3f} | **{r['over']:.3f}×** |")
    return rows, "\n".join(lines)


def kernel_seconds(fn) -> tuple[float, float]:
    """(GEMM, attention) self CPU seconds of one ``fn()`` call under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS)
    attention = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key)
    return gemm / 1e6, attention / 1e6


def gemm_floor(dense, hf, dense_seconds: float, hf_seconds: float) -> dict:
    """How far native dense could go past generate() if all its work but the kernels cost nothing."""
    dense_gemm, dense_attn = kernel_seconds(dense)
    hf_gemm, hf_attn = kernel_seconds(hf)
    return dict(floor=dict(dense_s=dense_seconds, hf_s=hf_seconds, dense_gemm=dense_gemm, dense_attn=dense_attn,
                           hf_gemm=hf_gemm, hf_attn=hf_attn, gemm_bound=hf_seconds / dense_gemm,
                           kernel_bound=hf_seconds / (dense_gemm + dense_attn)))


def floor_table(rows: list[dict]) -> str:
    lines = ["| batch | dense s | generate() s | dense/generate | dense GEMM s (share) | generate() GEMM s (share) "
             "| dense attention s | GEMM bound | GEMM + attention bound |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = r["floor"]
        lines.append(f"| {r['batch']} | {f['dense_s']:.2f} | {f['hf_s']:.2f} | {r['dense_vs_hf']:.2f}× | "
                     f"{f['dense_gemm']:.2f} ({f['dense_gemm'] / f['dense_s']:.0%}) | "
                     f"{f['hf_gemm']:.2f} ({f['hf_gemm'] / f['hf_s']:.0%}) | {f['dense_attn']:.2f} | "
                     f"**{f['gemm_bound']:.2f}×** | {f['kernel_bound']:.2f}× |")
    return "\n".join(lines)


def run_vllm(args) -> tuple[list[dict], str]:
    """vLLM (`VllmEngine`, dense) against the native engine's dense and deferred schedules: same model,
    prompts, greedy tokens and sampled exits (vLLM draws the same counter-based exits; checked)."""
    from rltt.vllm.vllm_engine import VllmEngine

    torch.set_num_threads(args.threads)
    model = build_model(args)
    native_engine = NativeEngine(model)
    vllm_engine = VllmEngine(model, kv_cache_gb=args.kv_cache_gb, max_model_len=args.prompt_len + args.new_tokens,
                             max_num_seqs=max(args.batch_sizes))
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = []
    try:
        for bsz in args.batch_sizes:
            gen = torch.Generator().manual_seed(bsz)
            group = args.group if bsz % args.group == 0 else 1
            distinct = torch.randint(1, args.vocab, (bsz // group, args.prompt_len), generator=gen).tolist()

            def params(schedule):
                return SamplingParams(temperature=0, max_new_tokens=args.new_tokens, exit_policy="sample",
                                      schedule=schedule, seed=1, ignore_eos=True, n=group)

            configs = {"dense": lambda: native_engine.generate(distinct, params("dense")),
                       "deferred": lambda: native_engine.generate(distinct, params("deferred")),
                       "vllm": lambda: vllm_engine.generate(distinct, params("dense"))}
            vllm_engine.generate(distinct, params("dense"))  # warm-up
            best, outs = {k: float("inf") for k in configs}, {}
            for _ in range(args.repeats):
                for name, fn in configs.items():
                    seconds, outs[name] = timed(fn, clock)
                    best[name] = min(best[name], seconds)
            same = bool(torch.equal(outs["vllm"].completion_ids, outs["dense"].completion_ids)
                        and torch.equal(outs["vllm"].exit_steps, outs["dense"].exit_steps))
            tokens = bsz * args.new_tokens
            row = dict(batch=bsz, group=group, mean_exit=float(outs["vllm"].exit_steps.float().mean()), same=same,
                       **{f"{k}_tps": tokens / v for k, v in best.items()})
            row["vs_dense"], row["vs_deferred"] = row["vllm_tps"] / row["dense_tps"], row["vllm_tps"] / row["deferred_tps"]
            rows.append(row)
            print(f"batch {bsz}: vLLM {row['vllm_tps']:.1f} tok/s, native dense {row['dense_tps']:.1f} "
                  f"({row['vs_dense']:.2f}x), deferred {row['deferred_tps']:.1f} ({row['vs_deferred']:.2f}x), "
                  f"same tokens and exits: {same}", flush=True)
    finally:
        vllm_engine.close()
    lines = ["| batch (prompts × G) | E[t*] | vLLM tok/s | native dense tok/s | native deferred tok/s "
             "| vLLM/dense | vLLM/deferred | same tokens + exits |",
             "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} ({r['batch'] // r['group']} × {r['group']}) | {r['mean_exit']:.2f} | "
                     f"{r['vllm_tps']:.1f} | {r['dense_tps']:.1f} | {r['deferred_tps']:.1f} | **{r['vs_dense']:.2f}×** | "
                     f"**{r['vs_deferred']:.2f}×** | {'yes' if r['same'] else 'no'} |")
    return rows, "\n".join(lines)


def run_buckets(args) -> tuple[list[dict], str]:
    """The unbucketed and the bucketed (eager) native engine on the same model and prompts, dense and
    deferred with sampled exits: tokens per second, their ratio and bitwise equality of the outputs."""
    from rltt.rollout.buckets import PassBuckets
    from rltt.rollout.graph_emulation import EmulatedGraphs

    torch.set_num_threads(args.threads)
    model = build_model(args)
    plain, bucketed = NativeEngine(model), NativeEngine(model, buckets=True)
    captured = NativeEngine(model)  # the capture path under CPU-emulated CUDA-graph semantics (host work only)
    captured.buckets = PassBuckets(model, capture=True, graphs=EmulatedGraphs())
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for bsz in args.batch_sizes:
        gen = torch.Generator().manual_seed(bsz)
        group = args.group if bsz % args.group == 0 else 1
        distinct = torch.randint(1, args.vocab, (bsz // group, args.prompt_len), generator=gen).tolist()
        for schedule in ("dense", "deferred"):
            params = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens, exit_policy="sample",
                                    schedule=schedule, seed=1, ignore_eos=True, n=group)
            bucketed.generate(distinct, params)  # warm-up (each bucket's buffers made once)
            best, outs = {"plain": float("inf"), "bucketed": float("inf")}, {}
            for _ in range(args.repeats):
                for name, engine in (("plain", plain), ("bucketed", bucketed)):
                    seconds, outs[name] = timed(lambda: engine.generate(distinct, params), clock)
                    best[name] = min(best[name], seconds)
            a, b = outs["plain"], outs["bucketed"]
            same = all(torch.equal(x, y) for x, y in (
                (a.completion_ids, b.completion_ids), (a.exit_steps, b.exit_steps), (a.logprobs, b.logprobs),
                (a.tempered_logprobs, b.tempered_logprobs), (a.gate_probs.nan_to_num(-1), b.gate_probs.nan_to_num(-1))))
            same = same and all(torch.equal(p.work, q.work) for p, q in zip(a.schedule.passes, b.schedule.passes))
            padded = [bucketed.buckets.size_of(int(p.entries())) for p in b.schedule.passes]
            tokens = bsz * args.new_tokens
            row = dict(batch=bsz, group=group, schedule=schedule, plain_tps=tokens / best["plain"],
                       bucketed_tps=tokens / best["bucketed"], passes=len(padded),
                       padded=sum(s is not None for s in padded) / max(1, len(padded)), same=same)
            row["ratio"] = row["bucketed_tps"] / row["plain_tps"]
            if args.host_work:
                row.update(bucket_host_work(model, distinct, params, plain, bucketed, captured, a))
            rows.append(row)
            print(f"batch {bsz} {schedule}: unbucketed {row['plain_tps']:.1f} tok/s, bucketed {row['bucketed_tps']:.1f} "
                  f"({row['ratio']:.2f}x), bucketed passes {row['padded']:.2f}, bitwise equal: {same}", flush=True)
    lines = ["| batch (prompts × G) | schedule | unbucketed tok/s | bucketed tok/s | bucketed/unbucketed "
             "| passes | share bucketed | bitwise equal |", "|---:|---|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} ({r['batch'] // r['group']} × {r['group']}) | {r['schedule']} | "
                     f"{r['plain_tps']:.1f} | {r['bucketed_tps']:.1f} | **{r['ratio']:.2f}×** | {r['passes']} | "
                     f"{r['padded']:.2f} | {'yes' if r['same'] else 'no'} |")
    if args.host_work:
        lines += ["", "| batch (prompts × G) | schedule | operators per (layer · pass): unbucketed | bucketed, eager "
                      "| with graphs (emulated) | syncs per pass: unbucketed / with graphs | emulated capture bitwise equal |",
                  "|---:|---|---:|---:|---:|---:|:---:|"]
        for r in rows:
            lines.append(f"| {r['batch']} ({r['batch'] // r['group']} × {r['group']}) | {r['schedule']} | "
                         f"{r['ops_plain']:.1f} | {r['ops_bucketed']:.1f} | **{r['ops_graphs']:.1f}** | "
                         f"{r['syncs_plain']:.2f} / {r['syncs_graphs']:.2f} | {'yes' if r['same_graphs'] else 'no'} |")
    return rows, "\n".join(lines)


def bucket_host_work(model, prompts, params, plain, bucketed, captured, reference) -> dict:
    """Operators per (layer · pass) of one call each (rltt.rollout.host_work, after a warm-up): unbucketed,
    bucketed run eagerly, and the capture path under CPU-emulated CUDA-graph semantics, counted as a GPU
    host would dispatch them — the profile's operators less those the emulated replays issued, plus one
    launch per replayed piece (`rltt.rollout.graph_emulation`)."""
    layers = model.config.num_hidden_layers
    out = {}
    for name, engine in (("plain", plain), ("bucketed", bucketed), ("graphs", captured)):
        got = engine.generate(prompts, params)  # warm-up: the graphs are captured here
        if name == "graphs":
            out["same_graphs"] = bool(torch.equal(got.logprobs, reference.logprobs)
                                      and torch.equal(got.completion_ids, reference.completion_ids))
            graphs = engine.buckets.graphs
            dispatched, launches = graphs.dispatched, graphs.launches
        _, work = rollout_host_work(engine, prompts, params, warmup=False)
        operators = work.operators
        if name == "graphs":
            operators += -(graphs.dispatched - dispatched) + (graphs.launches - launches)
        out[f"ops_{name}"] = operators / max(1, work.passes * layers)
        out[f"syncs_{name}"] = work.per_pass(work.syncs)
    return out


def host_table(rows: list[dict]) -> str:
    lines = ["| batch (prompts × G) | schedule | tok/s | passes | operators per (layer · pass) "
             "| launches per (layer · pass) | syncs per pass | host tensors per pass | made in a pass (uploaded) "
             "| reads per pass (max) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for schedule in ("dense", "deferred"):
            w = r[f"{schedule}_host"]
            lines.append(f"| {r['batch']} ({r['batch'] // r['group']} × {r['group']}) | {schedule} | "
                         f"{r[f'{schedule}_tps']:.1f} | {w['passes']} | {w['operators_per_layer_pass']:.1f} | "
                         f"{w['launches_per_layer_pass']:.1f} | {w['syncs_per_pass']:.2f} | "
                         f"{w['host_tensors_per_pass']:.2f} | {w['made_per_pass']:.2f} ({w['uploads_per_pass']:.2f}) | "
                         f"{w['reads_per_pass']:.2f} ({w['max_reads_in_a_pass']}) |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = [
        "| batch (prompts × G) | E[t*] | dense tok/s | deferred tok/s | deferred/dense | passes/token dense → deferred "
        "| serial passes/token dense → deferred | entries dense → deferred (pending) | native final tok/s "
        "| generate() tok/s | native/generate | dense/generate | deferred/generate |",
        "|---:|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} ({r['batch'] // r['group']} × {r['group']}) | {r['mean_exit']:.2f} | {r['dense_tps']:.1f} | {r['deferred_tps']:.1f} | "
            f"**{r['ratio']:.2f}×** | {r['dense_ppt']:.2f} → {r['deferred_ppt']:.2f} | "
            f"{r['dense_serial']:.2f} → {r['deferred_serial']:.2f} | "
            f"{r['dense_entries']} → {r['deferred_entries']} ({r['pending']}) | {r['native_final_tps']:.1f} | "
            f"{r['hf_tps']:.1f} | **{r['vs_hf']:.2f}×** | {r['dense_vs_hf']:.2f}× | {r['deferred_vs_hf']:.2f}× |")
    return "\n".join(lines)


def write_section(path: Path, body: str, append: bool = False, heading: str = SECTION, notes: str = "") -> None:
    """Write this benchmark's part of RESULTS.md: the text under ``heading`` up to the next ``## ``
    or ``### `` heading, so subsections (``### vLLM engine``, earlier runs) and the other sections
    are kept. The part becomes ``body`` then ``notes``; ``append`` keeps the tables already there and
    adds ``body`` after them (before the notes, which are rewritten only if the part had them). A
    ``### `` heading that is not there yet goes at the end of this benchmark's ``## `` section."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^##+ |\Z)", re.S | re.M)
    found = pattern.search(text)
    parts = [body.strip()]
    if append and found:
        old = found.group(0)[len(heading):].strip()
        # the notes start with their first words ("Reading the figures"), however they were edited since
        cut = re.search(rf"^{re.escape(notes.strip().split('(')[0].strip())}", old, re.M) if notes else None
        if cut:
            old = old[:cut.start()].strip()
        parts = [old] + parts + ([notes.strip()] if cut else [])
    elif notes:
        parts.append(notes.strip())
    section = heading + "\n\n" + "\n\n".join(p for p in parts if p) + "\n"
    if found:
        text = text[:found.start()] + section + "\n" + text[found.end():]
    elif heading.startswith("### "):
        if not re.search(rf"^{re.escape(SECTION)}\n", text, re.M):
            text = text.rstrip() + "\n\n" + SECTION + "\n"
        parent = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M).search(text)
        text = text[:parent.end()].rstrip() + "\n\n" + section + "\n" + text[parent.end():]
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text.rstrip() + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--loops", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--mean-exit", type=float, default=2.5)
    parser.add_argument("--group", type=int, default=1,
                        help="G rows per distinct prompt, as in RL (the native engine shares each prompt's prefill)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy tokens (native final-exit tokens checked against generate()'s); > 0: sampled "
                             "tokens (generate() with do_sample, top_k=0, top_p=1: the same distribution, other draws)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: process CPU time (robust on a shared machine); wall: elapsed time")
    parser.add_argument("--engine", choices=("native", "vllm"), default="native",
                        help="vllm: VllmEngine against native dense and deferred (needs vLLM)")
    parser.add_argument("--kv-cache-gb", type=float, default=1, help="with --engine vllm: CPU KV cache space (GiB)")
    parser.add_argument("--host-work", action="store_true",
                        help="also profile one dense and one deferred call per batch size: operators per (layer · "
                             "pass) and syncs per pass (with --write: the ### Host work subsection, alone; with "
                             "--buckets: unbucketed, bucketed and with CUDA graphs emulated on CPU)")
    parser.add_argument("--gemm-floor", action="store_true",
                        help="also profile one dense and one generate() call per batch size: their GEMM and attention "
                             "time, and the most dense/generate() could reach if nothing else cost time (with "
                             "--write: the ### GEMM floor subsection, alone)")
    parser.add_argument("--buckets", action="store_true",
                        help="bucketed passes (run eagerly, as on CPU) against today's unbucketed passes, same "
                             "process: tok/s, ratio, bitwise equality (with --write: the ### Bucketed passes subsection)")
    parser.add_argument("--passes", action="store_true",
                        help="serial passes per new token of deferred against E[t*] (counts, no timing; with --write: "
                             "the ### Serial passes subsection)")
    parser.add_argument("--passes-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[32, 128],
                        help="with --passes: new tokens per row")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the model in bf16 on the GPU (use --clock wall)")
    parser.add_argument("--roofline", default=None,
                        help="device figures for the bounds (a name of rltt.planning.roofline.DEVICES, e.g. 'H100 SXM'); "
                             "default: the CUDA device's, none on CPU")
    parser.add_argument("--write", action="store_true",
                        help="update bench/RESULTS.md: this section's text up to its first ### subsection "
                             "(with --engine vllm: the ### vLLM engine subsection); subsections are kept")
    parser.add_argument("--append", action="store_true",
                        help="with --write: add this table after the ones there (before the notes) instead of replacing them")
    parser.add_argument("--episodes", action="store_true",
                        help="multi-turn episodes instead: continued rows vs re-submitted history (bench/episode_turns.py)")
    parser.add_argument("--rows", type=int, default=16, help="with --episodes: episodes (rows), --group per prompt")
    parser.add_argument("--turn-tokens", type=int, default=32, help="with --episodes: new tokens a turn at most")
    parser.add_argument("--answer", type=int, default=16, help="with --episodes: the environment's tokens per answer")
    parser.add_argument("--turns", type=int, default=4, help="with --episodes: turns per episode at most")
    parser.add_argument("--episode-tokens", type=int, default=512, help="with --episodes: an episode's token budget")
    parser.add_argument("--stop-ids", type=int, default=256,
                        help="with --episodes: ids 0..N-1 end a turn (about one token in V/N)")
    parser.add_argument("--schedule", choices=("dense", "deferred"), default="deferred", help="with --episodes")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.episodes:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from episode_turns import episodes_bench

        episodes_bench(args, build_model(args))
        print(f"total {time.perf_counter() - start:.0f} s")
        return
    if args.passes:
        rows, md = run_passes(args)
        md = (f"Model d={args.hidden}, L={args.layers}, T={args.loops}, V={args.vocab}, gate bias for E[t*] = "
              f"{args.mean_exit}; prompts of {args.prompt_len} tokens, one row per prompt.\n\n{md}")
        print(md)
        command = "python bench/rollout.py " + " ".join(sys.argv[1:] if argv is None else argv)
        if args.write:
            write_section(Path(__file__).with_name("RESULTS.md"), f"Command: `{command.strip()}`\n\n{md}\n",
                          heading=PASSES_SECTION, notes=PASSES_NOTES)
        return
    if args.device == "cuda" and args.clock == "cpu":
        parser.error("--device cuda: use --clock wall (process CPU time does not see the GPU's)")
    rows, md = run_vllm(args) if args.engine == "vllm" else run_buckets(args) if args.buckets else run(args)
    md = (f"Model d={args.hidden}, L={args.layers}, T={args.loops}, V={args.vocab}; prompts of {args.prompt_len} "
          f"tokens, {args.new_tokens} new tokens per row; {args.threads} thread(s); throughput in tokens per "
          f"{'CPU' if args.clock == 'cpu' else 'wall-clock'} second, best of {args.repeats}.\n\n{md}")
    print(md)
    command = "python bench/rollout.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.buckets:
        if args.write:
            write_section(Path(__file__).with_name("RESULTS.md"), f"Command: `{command.strip()}`\n\n{md}\n",
                          append=args.append, heading=BUCKET_SECTION, notes=BUCKET_NOTES)
        return
    if args.gemm_floor and args.engine == "native":
        floor = floor_table(rows)
        print(floor)
        if args.write:
            write_section(Path(__file__).with_name("RESULTS.md"), f"Command: `{command.strip()}`\n\n{md}\n\n{floor}\n",
                          heading=FLOOR_SECTION, notes=FLOOR_NOTES)
        return
    if args.host_work and args.engine == "native":
        host = host_table(rows)
        print(host)
        if args.write:
            write_section(Path(__file__).with_name("RESULTS.md"), f"Command: `{command.strip()}`\n\n{md}\n\n{host}\n",
                          append=args.append, heading=HOST_SECTION, notes=HOST_NOTES)
        return
    if args.write:
        body = f"Command: `{command.strip()}`\n\n{md}\n"
        vllm = args.engine == "vllm"
        write_section(Path(__file__).with_name("RESULTS.md"), body, append=args.append,
                      heading=VLLM_SECTION if vllm else SECTION, notes="" if vllm else NOTES)


if __name__ == "__main__":
    main()
