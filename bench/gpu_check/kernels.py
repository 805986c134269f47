"""The ``kernels`` section: the per-loop log-prob kernels against the naive reference, then their time and peak memory."""

from __future__ import annotations

import time

from .context import Context, PeakMemory, ratio
from .report import Deadline, SectionResult

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
    last, last_n = 0.0, None
    for shape in ctx.shapes.kernel_times:
        steps, n, d, vocab = shape
        tag = f"N{n}"
        setting = (f"bf16, T={steps}, N={n}, d={d}, V={vocab}, forward+backward, mean of {reps} after 1 warm-up; "
                   f"memory = peak above the inputs ({'max_memory_allocated' if ctx.cuda else 'peak RSS'})")
        # estimated from the last shape's time scaled by the token count (N = 1024 after N = 8192: an eighth, not
        # all of it), with a floor for the inputs' set-up and each implementation's warm-up
        if last and not deadline.allows(max(last * n / last_n, 0.2 * last) if ctx.cuda else 0):
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
        last, last_n = time.perf_counter() - start, n


def section_kernels(ctx: Context, sec: SectionResult, deadline: Deadline) -> None:
    from rltt.kernels import resolve_impl

    sec.add("auto_impl", resolve_impl("auto", ctx.device), "", f"rltt.kernels auto choice on {ctx.device.type}")
    kernel_checks(ctx, sec, deadline)
    kernel_times(ctx, sec, deadline)


