"""Benchmark: per-loop log-probs, fused/chunked vs naive (forward + backward).

CPU (default): every (implementation, config) runs in its own subprocess. The child builds
its inputs, runs ``--warmup`` untimed passes (default 0), resets the kernel's peak-RSS counter (``/proc/self/clear_refs``),
then times ``reps`` forward+backward passes and reads the peak RSS (``VmHWM``). Reported
memory is the peak *above* the RSS just before the timed passes (inputs, weight and torch
itself excluded), and the absolute peak. Naive configs whose logits cannot fit in RAM are
skipped and reported as such.

GPU (``--gpu``): Triton vs chunked vs naive in one process on CUDA, memory from
``torch.cuda.max_memory_allocated`` above the inputs' footprint.

    python bench/logprobs.py                 # CPU table (~10 min on 2 cores)
    python bench/logprobs.py --all           # + chunked at N=4k, V=152k (naive does not fit)
    python bench/logprobs.py --gpu           # CUDA table
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from rltt.telemetry.schema import GIB

STEPS, DIM = 4, 1024
TOKENS = (1024, 4096)
VOCABS = (32_768, 151_936)


def _inputs(tokens: int, vocab: int, device: str, dtype=torch.float32):
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(STEPS, tokens, DIM, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, DIM, generator=gen) / DIM ** 0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    return hidden, weight, targets


def _step(impl: str, hidden, weight, targets):
    from rltt.kernels import per_loop_logprobs

    out = per_loop_logprobs(hidden, weight, targets, impl=impl)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    hidden.grad = weight.grad = None


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(impl: str, tokens: int, vocab: int, reps: int, warmup: int) -> dict:
    """One config in this process; returns seconds per pass and memory in GiB."""
    hidden, weight, targets = _inputs(tokens, vocab, "cpu")
    for _ in range(warmup):
        _step(impl, hidden, weight, targets)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _rss_kib("VmRSS")
    start = time.perf_counter()
    for _ in range(reps):
        _step(impl, hidden, weight, targets)
    seconds = (time.perf_counter() - start) / reps
    peak = _rss_kib("VmHWM")
    return dict(seconds=seconds, extra_gib=(peak - base) / 2**20, peak_gib=peak / 2**20)


def _naive_fits(tokens: int, vocab: int) -> bool:
    """Naive needs ~4 fp32 (T*N, V) tensors alive at once (logits, log-softmax, grads)."""
    need = 4 * STEPS * tokens * vocab * 4
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return need < 0.8 * avail


def _run_child(impl, tokens, vocab, reps, warmup):
    cmd = [sys.executable, __file__, "--child", impl, str(tokens), str(vocab), str(reps), str(warmup)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def cpu_table(reps: int, warmup: int, include_unfit: bool) -> None:
    print(f"CPU, fp32, T={STEPS}, d={DIM}, forward+backward, {torch.get_num_threads()} threads, "
          f"reps={reps}, warm-up={warmup}; memory = peak RSS above the pre-pass RSS")
    header = (f"{'N':>5} {'V':>7} | {'naive s':>8} {'chunked s':>9} {'time ratio':>10} | "
              f"{'naive GiB':>9} {'chunked GiB':>11} {'mem ratio':>9} | {'abs peak naive/chunked GiB':>26}")
    print(header)
    print("-" * len(header))
    for tokens in TOKENS:
        for vocab in VOCABS:
            fits = _naive_fits(tokens, vocab)
            if not fits and not include_unfit:
                need = 4 * STEPS * tokens * vocab * 4 / GIB
                print(f"{tokens:>5} {vocab:>7} | naive needs ~{need:.0f} GiB (does not fit); "
                      "chunked-only row skipped (run with --all)", flush=True)
                continue
            chunked = _run_child("chunked", tokens, vocab, reps, warmup)
            if fits:
                naive = _run_child("reference", tokens, vocab, reps, warmup)
                print(f"{tokens:>5} {vocab:>7} | {naive['seconds']:>8.2f} {chunked['seconds']:>9.2f} "
                      f"{chunked['seconds'] / naive['seconds']:>10.2f} | {naive['extra_gib']:>9.2f} "
                      f"{chunked['extra_gib']:>11.3f} {chunked['extra_gib'] / naive['extra_gib']:>9.3f} | "
                      f"{naive['peak_gib']:>12.2f} / {chunked['peak_gib']:.2f}", flush=True)
            else:
                need = 4 * STEPS * tokens * vocab * 4 / GIB
                print(f"{tokens:>5} {vocab:>7} | {'skipped':>8} {chunked['seconds']:>9.2f} {'-':>10} | "
                      f"{'>' + format(need, '.0f'):>9} {chunked['extra_gib']:>11.3f} {'-':>9} | "
                      f"{'-':>12} / {chunked['peak_gib']:.2f}   (naive needs ~{need:.0f} GiB: does not fit)",
                      flush=True)


def gpu_table(reps: int, dtype: torch.dtype) -> None:
    print(f"CUDA {torch.cuda.get_device_name()}, {dtype}, T={STEPS}, d={DIM}, forward+backward, "
          f"reps={reps} (+1 warm-up); memory = max_memory_allocated above the inputs")
    print(f"{'N':>5} {'V':>7} {'impl':>9} | {'ms':>9} {'GiB':>8} | {'time/naive':>10} {'mem/naive':>9}")
    for tokens in TOKENS:
        for vocab in VOCABS:
            rows = {}
            for impl in ("reference", "chunked", "triton"):
                hidden, weight, targets = _inputs(tokens, vocab, "cuda", dtype)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                try:
                    _step(impl, hidden, weight, targets)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    for _ in range(reps):
                        _step(impl, hidden, weight, targets)
                    torch.cuda.synchronize()
                    ms = (time.perf_counter() - start) / reps * 1e3
                    rows[impl] = (ms, (torch.cuda.max_memory_allocated() - base) / GIB)
                except torch.cuda.OutOfMemoryError:
                    rows[impl] = None
                del hidden, weight, targets
                torch.cuda.empty_cache()
            naive = rows["reference"]
            for impl, row in rows.items():
                if row is None:
                    print(f"{tokens:>5} {vocab:>7} {impl:>9} | {'OOM':>9}")
                    continue
                ratios = (f"{row[0] / naive[0]:>10.2f} {row[1] / naive[1]:>9.3f}" if naive else "")
                print(f"{tokens:>5} {vocab:>7} {impl:>9} | {row[0]:>9.1f} {row[1]:>8.2f} | {ratios}",
                      flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="Triton vs chunked vs naive on CUDA")
    parser.add_argument("--reps", type=int, default=1, help="timed passes per config")
    parser.add_argument("--warmup", type=int, default=0, help="untimed passes first (CPU)")
    parser.add_argument("--all", action="store_true",
                        help="CPU: also time chunked where naive does not fit in RAM (slow)")
    parser.add_argument("--dtype", default="bfloat16", help="--gpu input dtype")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, tokens, vocab, reps, warmup = args.child
        print(json.dumps(child(impl, int(tokens), int(vocab), int(reps), int(warmup))))
    elif args.gpu:
        if not torch.cuda.is_available():
            sys.exit("--gpu needs a CUDA device")
        gpu_table(max(args.reps, 3), getattr(torch, args.dtype))
    else:
        cpu_table(args.reps, args.warmup, args.all)


if __name__ == "__main__":
    main()
