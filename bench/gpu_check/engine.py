"""The ``engine`` section (runs first; 240 s on the GPU): where the native engine stands against the device's
roofline, on the Ouro-shaped model, in this order:

1. **capture** — `NativeEngine` with ``rollout.cuda_graphs`` on, ``dense`` and ``deferred`` at batch 32, with
   the default attention (sdpa: its pieces between attention calls captured, the attention eager) and then
   the other one (triton: each bucketed pass captured whole); per schedule tokens/s of the fastest and of the
   median of the timed calls, serial passes per new token, the row passes per token and the mean exit step,
   the bound and the fraction of it reached; captures, graphs held per capture, and the graph memory
   against `rltt.planning.graph_memory.engine_graphs_bytes` (on CPU: the bucketed passes run eagerly and
   their buffers' bytes against the planned buffers);
2. **sweep** — batch 1 / 8 / 32 / 128 / 256, dense and deferred with the default engine (graphs on with CUDA);
3. **generate()** — native final-exit decoding against transformers' ``generate()`` at batch 32;
4. the sweep engine's graph memory against the plan;
5. **continuous** — continuous batching against chunks at ``chunk_rows`` = 32 / 128 / 256 (the default
   engine, graphs on with CUDA: both run through the same bucketed passes), each call 4 x ``chunk_rows``
   rows sampled at temperature 1 with a stop set of about V / ``new_tokens`` ids (random lengths, a
   geometric tail, capped at 2 x ``new_tokens``): tokens/s, the occupancy, the bound and the fraction.

Every setting is warmed up by one call (captures, new shapes, compiles land there), then timed over
``calls`` (≥ 3) calls; the figures are the fastest and the median. A setting whose warm-up call says its
timed calls do not fit the time left is skipped (recorded), never cut by the alarm. The bound is
`rltt.planning.roofline` with the device's data-sheet figures (none on CPU: the fractions are then absent).
"""

from __future__ import annotations

import time

from .context import GIB, MEAN_EXIT, Context, model_setting, ratio, spread
from .report import Deadline, SectionResult

#: seconds the capture comparison needs to start on the GPU (4 settings x 4 calls of about 1 s at batch 32,
#: captures and the Triton compile included); the sweep's settings are guarded by their own warm-up calls
CAPTURE_START_S = 30


class Meter:
    """Times the engine section's settings and adds their figures, bound and fraction included."""

    def __init__(self, ctx: Context, sec: SectionResult, deadline: Deadline, model):
        import torch

        from rltt.planning.roofline import device_spec
        from rltt.planning.shapes import ModelShape

        self.ctx, self.sec, self.deadline = ctx, sec, deadline
        self.shape = ModelShape.of(model.config)
        self.dtype_bytes = model.lm_head.weight.element_size()
        self.calls = max(3, ctx.shapes.engine["calls"])
        self.spec = device_spec(torch.cuda.get_device_name(ctx.device)) if ctx.cuda else None

    def run(self, what: str, fn):
        """One warm-up call, then ``calls`` timed ones when they fit: ``(seconds per call, last output)`` or
        None (skipped, recorded)."""
        warm_s, _ = self.ctx.timed(fn)
        self.sec.log(f"{what}: warm-up {warm_s:.2f} s")
        if not self.deadline.allows(self.calls * warm_s if self.ctx.cuda else 0):
            self.sec.skip(f"{what}: {self.calls} timed calls (warm-up {warm_s:.1f} s, {self.deadline.left():.0f} s "
                          f"left)")
            return None
        return self.ctx.timed_calls(fn, self.calls)

    def add(self, prefix: str, times: list[float], work, setting: str) -> None:
        """Tokens/s of the fastest and the median call, and the roofline's bound and fractions for ``work``
        (`rltt.planning.roofline.RolloutWork`)."""
        from rltt.planning.roofline import rollout_roofline

        fastest, median = spread(times)
        sec = self.sec
        sec.add(f"{prefix}.tok_s", round(work.tokens / fastest, 2), f"tok/s (fastest of {len(times)} calls)", setting)
        sec.add(f"{prefix}.tok_s_median", round(work.tokens / median, 2), f"tok/s (median of {len(times)} calls)",
                setting)
        sec.add(f"{prefix}.calls_s", [round(t, 4) for t in times], "s, each timed call", setting)
        if self.spec is None:
            unit = "(rltt.planning.roofline: no device figures on CPU, no bound)"
            sec.add(f"{prefix}.bound_tok_s", None, "tok/s " + unit, setting)
            sec.add(f"{prefix}.fraction", None, "of the bound (fastest call) " + unit, setting)
            return
        bound = rollout_roofline(self.shape, self.dtype_bytes, work, self.spec)
        unit = f"(rltt.planning.roofline, {self.spec.name}'s data sheet: {bound.limit}-bound)"
        sec.add(f"{prefix}.bound_tok_s", round(bound.tokens_per_s, 1), "tok/s " + unit, setting)
        sec.add(f"{prefix}.fraction", round(bound.fraction(fastest), 4), "of the bound (fastest call)", setting)
        sec.add(f"{prefix}.fraction_median", round(bound.fraction(median), 4), "of the bound (median call)", setting)


def _params(schedule: str, new_tokens: int, policy: str = "sample"):
    from rltt.rollout import SamplingParams

    return SamplingParams(temperature=0.0, max_new_tokens=new_tokens, exit_policy=policy, schedule=schedule, seed=1,
                          ignore_eos=True)


def _rollout_figures(meter: Meter, prefix: str, times, out, prompt_len: int, new_tokens: int, setting: str) -> None:
    from rltt.planning.roofline import RolloutWork

    sec = meter.sec
    work = RolloutWork.of(out.stats, prompt_len, new_tokens)
    meter.add(prefix, times, work, setting)
    exits = out.exit_steps.cpu()[out.completion_mask.cpu()]
    sec.add(f"{prefix}.passes_per_token", round(out.stats.passes / new_tokens, 4),
            "serial passes per new token (the batch's passes / new tokens per row)", setting)
    sec.add(f"{prefix}.row_passes_per_token", round(out.stats.passes_per_token, 4),
            "passes per token of a row (prefill included), averaged over rows", setting)
    sec.add(f"{prefix}.mean_exit_step", round(float(exits.float().mean()), 4), "steps (E[t*] of the sampled exits)",
            setting)


def _graph_memory(ctx: Context, sec: SectionResult, prefix: str, engine, before: int, attention: str,
                  setting: str) -> None:
    """The bytes an engine's buckets (and, with CUDA, its graph pool) keep against the plan for the buckets it
    met: `memory_reserved` now (cache emptied) less before the engine on CUDA, the buffers' bytes on CPU."""
    import torch

    from rltt.planning.graph_memory import engine_graphs_bytes

    from rltt.planning.shapes import ModelShape

    model = engine.model
    sizes = sorted(engine.buckets.buckets)
    planned = engine_graphs_bytes(ModelShape.of(model.config), model.lm_head.weight.element_size(), capture=ctx.cuda,
                                  sizes=sizes, attention=attention)
    if ctx.cuda:
        ctx.release()
        measured = torch.cuda.memory_reserved(ctx.device) - before
    else:
        measured = engine.buckets.nbytes()
    note = (f"{setting}; the buckets met ({sizes}): planned buffers (+ graph pool with CUDA) against "
            f"{'memory_reserved after the runs less before the engine, cache emptied' if ctx.cuda else 'their bytes'}")
    sec.add(f"{prefix}.graphs_planned_gib", round(planned / GIB, 4), "GiB", note)
    sec.add(f"{prefix}.graphs_measured_gib", round(measured / GIB, 4), "GiB", note)
    sec.add(f"{prefix}.graphs_planned/measured", ratio(planned, measured), "x", note)


def _new_engine(ctx: Context, model, attention: str):
    """An engine with its passes bucketed: CUDA graphs with CUDA, eager buckets on CPU; and the reserved bytes
    before it (CUDA)."""
    import torch

    from rltt.rollout import NativeEngine

    if ctx.cuda:
        ctx.release()
        before = torch.cuda.memory_reserved(ctx.device)
        return NativeEngine(model, cuda_graphs=True, attention=attention), before
    return NativeEngine(model, buckets=True, attention=attention), 0


def capture(ctx: Context, meter: Meter, model, prompts, base: str) -> None:
    """Item 1: dense and deferred at the capture batch with each attention (the default first)."""

    e, sec = ctx.shapes.engine, meter.sec
    ids = prompts(e["batch"], 5).tolist()
    seconds = {}
    for attention in ("sdpa", e["other_attention"]):
        if attention != "sdpa" and not meter.deadline.allows(1.5 * seconds["sdpa"] if ctx.cuda else 0):
            sec.skip(f"capture with {attention}")
            continue
        start = time.perf_counter()
        how = ("CUDA graphs" if ctx.cuda else "bucketed passes run eagerly (no CUDA)") + (
            ": sdpa's pieces between attention calls captured, the attention eager" if attention == "sdpa"
            else ": each bucketed pass captured whole, KV writes and slot attention inside")
        setting = (f"{base}; rollout.attention {attention} ({'default' if attention == 'sdpa' else 'the other'}), "
                   f"{how}; batch {e['batch']}, prompt {e['prompt_len']}, {e['new_tokens']} new tokens, greedy tokens, "
                   f"sampled exits (E[t*]={MEAN_EXIT} of {model.config.num_loops}); one warm-up call, then "
                   f"{meter.calls} timed")
        failed = len(sec.failures)
        with sec.step(f"capture {attention}"):
            engine, before = _new_engine(ctx, model, attention)
            try:
                fastest = {}
                for schedule in ("dense", "deferred"):
                    got = meter.run(f"capture {attention} {schedule}",
                                    lambda: engine.generate(ids, _params(schedule, e["new_tokens"])))
                    if got is None:
                        continue
                    times, out = got
                    fastest[schedule] = min(times)
                    _rollout_figures(meter, f"capture.{attention}.{schedule}", times, out, e["prompt_len"],
                                     e["new_tokens"], setting)
                    got = out = None  # the graph memory below counts the engine's bytes, not a rollout's
                sec.add(f"capture.{attention}.deferred/dense",
                        ratio(fastest.get("dense"), fastest.get("deferred")), "x (tokens/s, fastest calls)", setting)
                b = engine.buckets
                graphs = sum(len(c.pieces) for bucket in b.buckets.values() for c in bucket.graphs.values())
                sec.add(f"capture.{attention}.captures", b.captures, "(bucket, step kind) captures", setting)
                sec.add(f"capture.{attention}.graphs_per_capture", round(graphs / b.captures, 2) if b.captures else None,
                        "graphs (1: the whole pass; none without CUDA)", setting)
                sec.add(f"capture.{attention}.replayed_passes", b.replays, "passes", setting)
                sec.add(f"capture.{attention}.eager_bucketed_passes", b.eager, "passes", setting)
                _graph_memory(ctx, sec, f"capture.{attention}", engine, before, attention, setting)
            finally:
                engine = None
                ctx.release()
        if ctx.cuda and len(sec.failures) > failed:
            from .rollouts import cuda_usable

            sec.add(f"capture.{attention}.cuda_usable_after_failure", cuda_usable(), "", setting)
        seconds[attention] = time.perf_counter() - start


def sweep(ctx: Context, meter: Meter, model, prompts, base: str) -> None:
    """Item 2: dense and deferred at each batch size, the default engine (graphs on with CUDA); then its graph
    memory against the plan."""
    import torch

    from rltt.rollout import NativeEngine

    e, sec = ctx.shapes.engine, meter.sec
    if ctx.cuda:
        ctx.release()
    before = torch.cuda.memory_reserved(ctx.device) if ctx.cuda else 0
    engine = NativeEngine(model)  # rollout.cuda_graphs null: on with CUDA; sdpa
    setting_of = (lambda bsz: f"{base}; the default engine (rollout.cuda_graphs null, sdpa), batch {bsz}, prompt "
                  f"{e['prompt_len']}, {e['new_tokens']} new tokens, greedy tokens, sampled exits; one warm-up call "
                  f"per schedule, then {meter.calls} timed")
    try:
        last = None  # (batch, seconds of its median calls, both schedules)
        for bsz in e["batches"]:
            # the next batch size from the last one's calls, scaled by its rows (memory-bound passes grow less)
            if last and not meter.deadline.allows((meter.calls + 1) * last[1] * bsz / last[0] if ctx.cuda else 0):
                sec.skip(f"sweep at batch {bsz}")
                continue
            setting = setting_of(bsz)
            with sec.step(f"sweep at batch {bsz}"):
                ids = prompts(bsz, bsz).tolist()
                outs, medians, fast = {}, 0.0, {}
                for schedule in ("dense", "deferred"):
                    got = meter.run(f"sweep b{bsz} {schedule}",
                                    lambda: engine.generate(ids, _params(schedule, e["new_tokens"])))
                    if got is None:
                        continue
                    times, outs[schedule] = got
                    got = None
                    medians += spread(times)[1]
                    fast[schedule] = min(times)
                    _rollout_figures(meter, f"sweep.b{bsz}.{schedule}", times, outs[schedule], e["prompt_len"],
                                     e["new_tokens"], setting)
                if len(outs) == 2:
                    sec.add(f"sweep.b{bsz}.deferred/dense", ratio(fast["dense"], fast["deferred"]), "x (fastest calls)",
                            setting + "; target >= 1.4x at batch >= 8 with E[t*] about 2.5 of 4")
                    a, b = outs["dense"], outs["deferred"]
                    sec.add(f"sweep.b{bsz}.same_tokens_and_exits",
                            bool(torch.equal(a.exit_steps.cpu(), b.exit_steps.cpu())
                                 and torch.equal(a.completion_ids.cpu(), b.completion_ids.cpu())), "", setting)
                    last = (bsz, medians)
                del outs
        if engine.buckets is not None:
            _graph_memory(ctx, sec, "sweep", engine, before, "sdpa", setting_of("sizes above"))
        else:  # CPU: the default engine runs its passes unbucketed (the capture engines above measured buckets)
            for key in ("graphs_planned_gib", "graphs_measured_gib", "graphs_planned/measured"):
                sec.add(f"sweep.{key}", None, "(the default engine on CPU keeps no buckets)", setting_of("sizes above"))
    finally:
        engine = None
        ctx.release()


def versus_generate(ctx: Context, meter: Meter, model, prompts, base: str) -> None:
    """Item 3: native final-exit decoding (deferred schedule: the same FLOPs per token) against
    transformers' ``generate()`` at the generate batch."""
    import torch

    from rltt.planning.roofline import RolloutWork
    from rltt.rollout import NativeEngine

    e, sec = ctx.shapes.engine, meter.sec
    gb, new, plen = e["generate_batch"], e["new_tokens"], e["prompt_len"]
    setting = (f"{base}; batch {gb}, prompt {plen}, {new} new tokens, greedy, final exits: the native deferred "
               f"schedule (default engine) against transformers generate() (same FLOPs per token); one warm-up "
               f"call each, then {meter.calls} timed; target native >= 5x; bf16 rounding may split greedy paths")
    ids = prompts(gb, 1000 + gb)
    engine = NativeEngine(model)
    got = meter.run("native final", lambda: engine.generate(ids.tolist(), _params("deferred", new, "final")))
    if got is None:
        return
    native_times, out = got
    _rollout_figures(meter, f"generate.b{gb}.native", native_times, out, plen, new, setting)
    hf_ids = ids.to(ctx.device)

    def hf():
        with torch.no_grad():
            return model.generate(hf_ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    got = meter.run("generate()", hf)
    if got is None:
        return
    hf_times, hf_out = got
    T = model.config.num_loops
    # generate() runs every token through all T steps, one forward per token: T passes per token (prefill in
    # the first), every row in every pass
    work = RolloutWork(passes=T * new, row_passes=gb * T * new, entries=gb * T * (plen + new - 1), tokens=gb * new,
                       steps=new, context=plen + new / 2)
    meter.add(f"generate.b{gb}.hf", hf_times, work, setting)
    sec.add(f"generate.b{gb}.native/generate", ratio(min(hf_times), min(native_times)), "x (fastest calls)", setting)
    same = (out.completion_ids.cpu() == hf_out[:, plen:].cpu()).all(dim=1).float().mean()
    sec.add(f"generate.b{gb}.identical_rows_frac", round(float(same), 4), "", setting)


def continuous(ctx: Context, meter: Meter, model, prompts, base: str) -> None:
    """Item 5: continuous batching against chunks of whole prompts at each ``chunk_rows``, same rows."""
    from rltt.rollout import NativeEngine, SamplingParams

    e, sec = ctx.shapes.engine, meter.sec
    vocab, new = model.config.vocab_size, e["new_tokens"]
    stops = list(range(1, vocab, max(2, new)))  # about V / new_tokens ids: a stop every ~new_tokens tokens
    params = SamplingParams(temperature=1.0, max_new_tokens=2 * new, exit_policy="sample", schedule="deferred",
                            seed=3, stop_token_ids=stops, n=4)
    for rows in e["continuous_batches"]:
        setting = (f"{base}; rollout.chunk_rows {rows}, a call of {rows} prompts x 4 rows, prompt {e['prompt_len']}, "
                   f"temperature 1, {len(stops)} stop ids (lengths ~ geometric, mean ~{new}, cap {2 * new}), deferred, "
                   f"sampled exits; the default engine (graphs on with CUDA); one warm-up call, then {meter.calls} timed")
        ids = prompts(rows, 7000 + rows).tolist()
        fastest = {}
        with sec.step(f"continuous at chunk_rows {rows}"):
            for name, flag in (("chunks", False), ("continuous", True)):
                engine = NativeEngine(model, rows, continuous=flag)
                got = meter.run(f"{name} r{rows}", lambda: engine.generate(ids, params))
                if got is None:
                    continue
                times, out = got
                fastest[name] = min(times)
                prefix = f"continuous.r{rows}.{name}"
                _rollout_figures(meter, prefix, times, out, e["prompt_len"], 2 * new, setting)
                sec.add(f"{prefix}.occupancy", round(out.stats.occupancy, 4), "live rows per pass / chunk_rows",
                        setting)
                engine = got = out = None
                ctx.release()
            sec.add(f"continuous.r{rows}.continuous/chunks", ratio(fastest.get("chunks"), fastest.get("continuous")),
                    "x (tokens/s, fastest calls)", setting + "; target >= 1.3x at chunk_rows 128")


def section_engine(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    import torch

    build_s, model = ctx.timed(ctx.ouro_model)
    e = ctx.shapes.engine
    base = model_setting(model)
    sec.add("model_build_s", round(build_s, 2), "s", base)
    meter = Meter(ctx, sec, deadline, model)
    sec.add("device_spec", meter.spec.name if meter.spec else None, "",
            "rltt.planning.roofline.device_spec of the device's name (None: not in the table, no bounds)")
    vocab = model.config.vocab_size

    def prompts(bsz, seed):
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(1, vocab, (bsz, e["prompt_len"]), generator=gen)

    if not deadline.allows(CAPTURE_START_S if ctx.cuda else 0):
        sec.skip("capture")
    else:
        capture(ctx, meter, model, prompts, base)
    sweep(ctx, meter, model, prompts, base)
    with sec.step(f"native vs generate() at batch {e['generate_batch']}"):
        versus_generate(ctx, meter, model, prompts, base)
    continuous(ctx, meter, model, prompts, base)
