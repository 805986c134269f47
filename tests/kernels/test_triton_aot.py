"""rltt's Triton kernels compile for real GPUs here, without one: Triton compiles ahead of time for
a named target (``GPUTarget("cuda", capability, 32)``) and its bundled ptxas assembles the cubin.

Every kernel of `rltt.kernels.triton_logprobs` is compiled for sm_80 (A100) and sm_90 (H100/H200)
in bf16, fp16 and fp32 (fp32 with both dot precisions: ``ieee``, and ``tf32`` when
``torch.backends.cuda.matmul.allow_tf32`` is on), and for ``learner.lm_head_dtype: fp32`` on a
16-bit model: fp32 hidden states with a bf16 or fp16 weight, upcast tile by tile inside the kernel
(``UPCAST``; no fp32 copy of the weight), in both precisions. Each is compiled with the tile sizes,
dot precision and warp count the CUDA dispatch uses (`triton_logprobs._config` on a CUDA device)
and the argument dtypes of its launches (`triton_forward`, `triton_backward`). Each cubin must
exist, hold the kernel, use the tensor-core instructions of its architecture (mma on sm_80, wgmma
on sm_90, for 16-bit and tf32 dots) and fit the architecture's shared memory per block; an
upcast weight must be read as 16-bit and converted in the kernel. What this cannot check:
register pressure at launch and the numbers (`bench/gpu_check` runs them on a GPU).

The test session runs Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` before
triton is imported, which makes triton's own helpers interpreted functions), so the compilation
runs in one child process without it. Skipped, with the reason, only where Triton, its CUDA
backend or its bundled ptxas is absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

HAVE_TRITON = importlib.util.find_spec("triton") is not None
ROOT = Path(__file__).resolve().parents[2]

# shared memory one block may use (the opt-in maximum), bytes
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
KERNELS = ("_fwd_kernel", "_grad_logits_kernel", "_fwd_trunc_kernel", "_grad_logits_trunc_kernel")
#: (arch, hidden dtype, weight dtype, precision): one input dtype, then an fp32 LM head on a 16-bit model
CASES = [(arch, dtype, dtype, precision) for arch in (80, 90) for dtype in ("bf16", "fp16", "fp32")
         for precision in (("ieee", "tf32") if dtype == "fp32" else ("ieee",))]
CASES += [(arch, "fp32", weight, precision) for arch in (80, 90) for weight in ("bf16", "fp16")
          for precision in ("ieee", "tf32")]


def case_id(arch: int, dtype: str, weight: str, precision: str) -> str:
    return f"sm{arch}-{dtype}-{precision}" if weight == dtype else f"sm{arch}-{dtype}+{weight}w-{precision}"


def _signature(kernel: str, t: str, wt: str | None = None) -> list[str]:
    """Argument types of the kernel's launch, constexprs left out: pointers to the hidden dtype ``t``
    and the weight dtype ``wt`` (default ``t``; the logit-gradient buffer is allocated in h's
    dtype), int64 targets, fp32 statistics, int32 sizes, fp32 inverse temperature; the truncation
    kernels add int64 floors and fp32 thresholds after the targets and one more fp32 statistic
    (s_K, or the kept-set logsumexp)."""
    stats = ["*fp32"] * 4
    floors = ["*i64", "*fp32"] if "trunc" in kernel else []
    if "trunc" in kernel:
        stats = stats + ["*fp32"]
    wt = wt or t
    if kernel.startswith("_fwd"):
        return [f"*{t}", f"*{wt}", "*i64", *floors, *stats, "i32", "i32", "i32", "i32", "fp32"]
    return [f"*{t}", f"*{wt}", "*i64", *floors, *stats, f"*{t}", "i32", "i32", "i32", "i32", "i32", "i32", "fp32"]


def missing_backend() -> str | None:
    """Why Triton cannot compile for CUDA here (None: it can)."""
    if not HAVE_TRITON:
        return "triton is not installed (pip install 'rltt[triton]')"
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        return "this triton build ships no CUDA backend"
    from triton.backends.nvidia.compiler import get_ptxas

    for arch in SHARED_LIMIT:
        ptxas = get_ptxas(arch).path
        if not ptxas or not os.access(ptxas, os.X_OK):
            return f"this triton build ships no ptxas for sm_{arch} ({ptxas!r})"
    return None


def compile_case(kernel: str, arch: int, dtype: str, precision: str, weight: str | None = None) -> dict:
    """Compile one kernel for sm_<arch> as the CUDA dispatch would launch it (hidden states in
    ``dtype``, the weight in ``weight``, default the same); what the test checks."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    from rltt.kernels import triton_logprobs

    weight = weight or dtype
    torch_dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:  # the dispatch's own choice
        cfg = triton_logprobs._config(torch.device("cuda"), torch_dtypes[dtype], torch_dtypes[weight])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    options = {"num_warps": cfg.pop("num_warps")}
    fn = triton.jit(getattr(triton_logprobs, kernel))
    if "ROUND" in fn.arg_names and "ROUND" not in cfg:  # kept-set rounding: the 16-bit model's rollout dtype
        cfg["ROUND"] = triton_logprobs._ROUND_CODES[torch_dtypes[weight] if weight != "fp32" else None]
    types = _signature(kernel, dtype, weight)
    runtime_args = [a for a in fn.arg_names if a not in cfg]
    if len(types) != len(runtime_args):
        return {"error": f"{kernel} takes {len(runtime_args)} runtime arguments, the test types {len(types)}"}
    signature = dict(zip(runtime_args, types))
    signature.update({name: "constexpr" for name in cfg})
    # torch's allocations are 16-byte aligned: the JIT specialises pointers so, and so does this
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if signature[a].startswith("*")}
    compiled = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs=cfg, attrs=aligned),
                              target=GPUTarget("cuda", arch, 32), options=options)
    ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    return {"config": {k: v for k, v in cfg.items()}, "name": compiled.metadata.name,
            "num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared,
            "ptx_target": next((line.split()[1] for line in ptx.splitlines() if line.startswith(".target")), None),
            "cubin_elf": isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF",
            "cubin_has_kernel": isinstance(cubin, bytes) and kernel.encode() in cubin,
            "wgmma": "wgmma.mma_async" in ptx, "mma": "mma.sync" in ptx,
            # a 16-bit weight read as such and widened in registers (cvt.f32.bf16 / cvt.f32.f16)
            "cvt_to_f32": {t: f"cvt.f32.{t}" in ptx for t in ("bf16", "f16")}}


def main() -> None:
    out = {}
    for kernel in KERNELS:
        for arch, dtype, weight, precision in CASES:
            key = f"{kernel}-{case_id(arch, dtype, weight, precision)}"
            try:
                out[key] = compile_case(kernel, arch, dtype, precision, weight)
            except Exception as exc:  # noqa: BLE001 - reported per case
                out[key] = {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
    print("RESULTS " + json.dumps(out))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    reason = missing_backend()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))  # compiled here, not read from a cache
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", "from tests.kernels.test_triton_aot import main; main()"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch, dtype, weight, precision", CASES, ids=[case_id(*c) for c in CASES])
def test_kernel_compiles_for_gpu(compiled, kernel, arch, dtype, weight, precision):
    got = compiled[f"{kernel}-{case_id(arch, dtype, weight, precision)}"]
    assert "error" not in got, got.get("error")
    cfg = got["config"]
    assert cfg["PRECISION"] == precision
    # one dtype: tiles go to the tensor cores as they are; an fp32 head on a 16-bit weight: upcast in the kernel
    assert cfg["UPCAST"] is (weight != dtype)
    if weight != dtype:
        assert got["cvt_to_f32"][{"bf16": "bf16", "fp16": "f16"}[weight]], f"no in-kernel {weight} -> fp32 conversion"
    assert cfg["BLOCK_M"] >= 16 and cfg["BLOCK_V"] >= 16 and cfg["BLOCK_D"] >= 16
    assert got["name"] == kernel and got["num_warps"] == 4
    assert got["ptx_target"] == (f"sm_{arch}a" if arch >= 90 else f"sm_{arch}")
    assert got["cubin_elf"] and got["cubin_has_kernel"]
    assert 0 < got["shared"] <= SHARED_LIMIT[arch], got["shared"]
    if dtype != "fp32" or precision == "tf32":  # tensor cores: wgmma on Hopper, mma on Ampere
        assert got["wgmma" if arch == 90 else "mma"], f"no tensor-core dot in the PTX for sm_{arch} {dtype}"
    else:
        assert not got["wgmma"]  # IEEE fp32 dots: no tensor cores
