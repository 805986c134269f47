"""The ``rollouts`` section: the engine's attention cost per new shape, CUDA graphs on and off with the host
work per pass, ``rollout.attention: triton``, bitwise replay and the host work at batch 1 (the batch sweep
and ``generate()`` are the ``engine`` section's)."""

from __future__ import annotations

import statistics
import time

from .context import GIB, Context, model_setting, ratio, spread
from .report import Deadline, SectionResult

#: timed calls of each graphs on/off and Triton figure (after one warm-up call); the figures are their
#: min and median
TIMED_CALLS = 3


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
    # work per pass, the Triton attention, bitwise replay, the host work at batch 1; a sub-step the time left
    # cannot cover is skipped (recorded), not cut by the section's alarm
    with sec.step("attention cost per new shape"):
        attention_shape_cost(ctx, sec, model, base)
    warm = prompts(8, 0)
    with sec.step("warm-up (dense and deferred, 4 tokens)"):
        for schedule in ("dense", "deferred"):
            native(warm, schedule, "sample", new_tokens=4)

    sdpa_on: dict = {}  # the graphs-on SDPA rollouts, compared with the Triton attention's at the end
    with sec.step("CUDA graphs on and off"):
        cuda_graphs_on_off(ctx, sec, model, prompts(s.graphs_batch, 5), base, deadline, kept=sdpa_on)

    # rollout.attention triton at the graphs comparison's batch and length, against that sub-step's SDPA
    # rollouts (a compile error or a failed launch is recorded as this sub-step's failure)
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
            del batch, replayed

    # host work per pass at batch 1 (rltt.rollout.host_work: profiler counts, one call each of HOST_WORK_TOKENS
    # tokens: under the profiler 128 tokens at batch 1 took over 100 s on the H200)
    tokens = min(s.new_tokens, HOST_WORK_TOKENS)
    setting = (f"{base}; batch 1, prompt {s.prompt_len}, {tokens} new tokens, greedy tokens, sampled exits (gate bias "
               f"for E[t*]=2.5); host work profiled over one call after the warm-up above")
    if not deadline.allows(HOST_WORK_S if ctx.cuda else 1):
        sec.skip("host work at batch 1")
        return
    with sec.step("host work at batch 1"):
        from rltt.rollout.host_work import rollout_host_work

        ids = prompts(1, 1)
        for schedule in ("dense", "deferred"):
            _, work = rollout_host_work(engine, ids.tolist(), SamplingParams(
                temperature=0.0, max_new_tokens=tokens, exit_policy="sample", schedule=schedule, seed=1,
                ignore_eos=True), warmup=False)
            for key, value in work.summary().items():
                sec.add(f"rollout.b1.{schedule}.{key}", round(value, 3), "", setting)


#: seconds the profiled batch-1 calls need to start on the GPU (2 x 16 tokens, the profiler slowing each
#: operator: about 2 x 64 passes at 19 ms eager, x 3 under the profiler)
HOST_WORK_S = 20


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
        # per call, not averaged: the process's first SDPA call of a backend pays one-time set-up (the H200's
        # 489 ms "average" of 2026-12-04b was mostly that one call)
        sec.add(f"attention.{label}.new_shape_calls_ms", [round(1e3 * t, 3) for t in new], "ms, each call", setting)
        sec.add(f"attention.{label}.new_shape_first_ms", round(1e3 * new[0], 3), "ms (the first call: one-time set-up "
                "included)", setting)
        sec.add(f"attention.{label}.new_shape_ms", round(1e3 * statistics.median(new[1:]), 3),
                "ms per call (median of the calls after the first)", setting)
        sec.add(f"attention.{label}.repeat_ms", round(1e3 * statistics.median(again), 3), "ms per call (median)",
                setting)


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
               f"on = {on_label}, off = unbucketed passes; {TIMED_CALLS} timed calls each after a warm-up call: "
               f"tok/s of the fastest (tok_s) and of the median (tok_s_median)")
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
            # the next run is estimated from the last one (deferred's and "off"'s cost up to 2.5x "on"'s dense on
            # the H200); the later sub-steps guard themselves
            if last and not deadline.allows(2.5 * last if ctx.cuda else 0):
                sec.skip(f"graphs {schedule} {name}")
                continue
            start = time.perf_counter()
            warm_s, _ = ctx.timed(lambda: engine.generate(ids.tolist(), params(schedule)))  # on: captures its buckets
            sec.log(f"graphs {schedule} {name}: warm-up {warm_s:.1f} s")
            calls, outs[schedule, name] = ctx.timed_calls(lambda: engine.generate(ids.tolist(), params(schedule)),
                                                          TIMED_CALLS)
            t, median = spread(calls)
            times[schedule, name] = t
            if name == "on" and kept is not None:
                kept[schedule] = dict(_kept(outs[schedule, name]), seconds=t)
            sec.add(f"graphs.{schedule}.{name}.warmup_s", round(warm_s, 2), "s (first call: captures, new shapes)",
                    setting)
            sec.add(f"graphs.{schedule}.{name}.tok_s", round(bsz * new_tokens / t, 2), "tok/s (fastest call)", setting)
            sec.add(f"graphs.{schedule}.{name}.tok_s_median", round(bsz * new_tokens / median, 2), "tok/s (median call)",
                    setting)
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
    replayed = replay_logprobs(model, sampled, on.buckets)  # the engine's buckets: the same graphs
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


#: new tokens of the batch sweep's profiled host-work call (the profiler slows each operator down)
HOST_WORK_TOKENS = 16


#: the time left the Triton attention's sub-step needs to start on the GPU: the whole sub-step took 26-30 s on
#: the H200 (2026-12-04b, one timed call per schedule); with 3 timed calls per schedule, 35 s to start (the
#: second schedule and the replay are guarded again inside)
TRITON_ATTENTION_S = 35


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
    from rltt.rollout.host_work import rollout_host_work

    bsz, new_tokens = ids.shape[0], graphs_new_tokens(ctx)
    on_label = ("CUDA graphs, each bucketed pass captured whole (one graph per bucket and step kind: every layer's "
                "KV write and slot attention inside it, not run eagerly between pieces as sdpa's are)" if ctx.cuda
                else "bucketed passes run eagerly (no CUDA), Triton's interpreter")
    setting = (f"{base}; rollout.attention triton, {on_label}; batch {bsz}, prompt {ids.shape[1]}, {new_tokens} "
               f"new tokens, greedy tokens, sampled exits; {TIMED_CALLS} timed calls after a warm-up call (the warm-up "
               f"compiles the kernel and captures this engine's graphs), the fastest reported (tok_s) and the "
               f"median (tok_s_median); the prompts and parameters of graphs.*.on")
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
    for schedule in ("deferred", "dense"):  # deferred first: the gap to dense is what the kernel is for
        if last and not deadline.allows(1.5 * last + 5 if ctx.cuda else 0):
            sec.skip(f"Triton attention {schedule}")
            continue
        start = time.perf_counter()
        warm_s, _ = ctx.timed(lambda: engine.generate(ids.tolist(), params(schedule)))
        sec.log(f"triton {schedule}: warm-up {warm_s:.1f} s")
        calls, out = ctx.timed_calls(lambda: engine.generate(ids.tolist(), params(schedule)), TIMED_CALLS)
        t, median = spread(calls)
        times[schedule] = t
        sec.add(f"triton.{schedule}.warmup_s", round(warm_s, 2), "s (first call: compile, captures, new shapes)",
                setting)
        sec.add(f"triton.{schedule}.tok_s", round(bsz * new_tokens / t, 2), "tok/s (fastest call)", setting)
        sec.add(f"triton.{schedule}.tok_s_median", round(bsz * new_tokens / median, 2), "tok/s (median call)",
                setting)
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
    t_replay, replayed = ctx.timed(lambda: replay_logprobs(model, sampled, engine.buckets))
    got, want = replayed.logprobs.cpu(), sampled.logprobs.cpu()
    sec.add("triton.replay_bitwise_equal",
            bool(torch.equal(got, want)
                 and torch.equal(replayed.tempered_logprobs.cpu(), sampled.tempered_logprobs.cpu())
                 and torch.equal(replayed.exit_logprobs.cpu(), sampled.exit_logprobs.cpu())), "", replay_setting)
    sec.add("triton.replay_max_abs_diff", float((got - want).abs().max()), "nats", replay_setting)
    sec.add("triton.replay_s", round(t_replay, 3), "s", replay_setting)

