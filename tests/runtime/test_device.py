"""Why CUDA is unusable, in one line (`rltt.runtime.device.cuda_unusable`): torch built without CUDA,
no driver, a driver older than torch's CUDA major, torch.cuda's own error, a missing device index;
``auto`` says so on stderr instead of falling back to the CPU silently where a driver is installed.
The machine's answers (torch.version.cuda, torch.cuda, the driver's CUDA version) are monkeypatched."""

from __future__ import annotations

import pytest
import torch

from rltt.errors import RlttError
from rltt.runtime import device as dev


@pytest.fixture
def machine(monkeypatch):
    """A CUDA 13.0 torch on a machine whose driver and GPUs the test sets."""
    dev._warn_cpu_fallback.cache_clear()

    def set_(cuda="13.0", available=False, count=0, driver=None, release=None, init_error=None):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(dev, "driver_cuda_version", lambda: driver)
        monkeypatch.setattr(dev, "driver_release", lambda path=dev.DRIVER_VERSION_FILE: release)

        def init():
            if init_error is not None:
                raise init_error
        monkeypatch.setattr(torch.cuda, "init", init)
    yield set_
    dev._warn_cpu_fallback.cache_clear()


def test_torch_without_cuda(machine):
    machine(cuda=None)
    reason = dev.cuda_unusable()
    assert reason.startswith(f"torch {torch.__version__} is built without CUDA") and "whl/cu130" in reason


def test_no_driver(machine):
    machine(driver=None)
    assert dev.cuda_unusable().startswith("no NVIDIA driver here (libcuda.so.1 does not load)")


def test_driver_older_than_torchs_cuda_major(machine):
    machine(driver=(12, 2), release="535.104.05")
    reason = dev.cuda_unusable()
    assert reason == (f"the NVIDIA driver 535.104.05 supports CUDA up to 12.2 but torch {torch.__version__} is "
                      "built for CUDA 13.0: update the driver to >= 580.65.06 or install torch built for CUDA 12")
    machine(cuda="12.8", driver=(11, 8))
    assert "supports CUDA up to 11.8 but" in dev.cuda_unusable() and ">= 525.60.13" in dev.cuda_unusable()


def test_same_major_gives_torchs_own_error_with_both_versions(machine, monkeypatch):
    machine(driver=(13, 0), release="580.65.06",
            init_error=RuntimeError("Error 802: system not yet initialized\nsecond line"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert dev.cuda_unusable() == ("torch.cuda: Error 802: system not yet initialized; the NVIDIA driver 580.65.06 "
                                   f"supports CUDA up to 13.0, torch {torch.__version__} is built for CUDA 13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    machine(driver=(13, 1))
    assert dev.cuda_unusable().startswith("torch.cuda: no CUDA device is visible (CUDA_VISIBLE_DEVICES='')")


def test_device_index_beyond_the_visible_ones(machine):
    machine(available=True, count=1)
    assert dev.cuda_unusable(0) is None
    assert dev.cuda_unusable(1) == "only 1 CUDA device(s) are visible"
    with pytest.raises(RlttError, match=r"'model\.device': is 'cuda:1' but CUDA is unusable here: only 1"):
        dev.pick_device("cuda:1")


def test_pick_device_names_the_key_in_one_line(machine):
    machine(driver=(12, 4))
    with pytest.raises(RlttError) as err:
        dev.pick_device("cuda", "model.device")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("recipe key 'model.device': is 'cuda' but CUDA is unusable here: ")
    assert "supports CUDA up to 12.4" in msg and msg.endswith("or run on the CPU: model.device=cpu")
    dev.require_cuda("cpu")  # nothing to check
    dev.require_cuda("auto")


def test_auto_warns_when_a_driver_is_there_but_cuda_is_not(machine, capsys):
    machine(driver=(12, 4))
    assert dev.pick_device("auto") == torch.device("cpu")
    assert dev.pick_device("auto") == torch.device("cpu")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("WARNING: model.device=auto runs on the CPU") and "12.4" in err[0]
    machine(driver=None)  # a CPU machine: the CPU is what auto means, nothing to say
    dev._warn_cpu_fallback.cache_clear()
    assert dev.pick_device("auto") == torch.device("cpu") and capsys.readouterr().err == ""
    machine(available=True, count=1)
    assert dev.pick_device("auto") == torch.device("cuda")


def test_driver_release_reads_both_module_kinds(tmp_path):
    path = tmp_path / "version"
    path.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
                    "GCC version:  gcc version 12.2.0\n")
    assert dev.driver_release(str(path)) == "535.104.05"
    path.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
                    "(dvs-builder@U16-I3-B03-4-3)  Tue Jul 22 19:32:13 UTC 2025\n")
    assert dev.driver_release(str(path)) == "580.65.06"
    assert dev.driver_release(str(tmp_path / "absent")) is None


def test_driver_cuda_version_here_is_none_or_a_version():
    got = dev.driver_cuda_version()
    assert got is None or (isinstance(got, tuple) and got[0] >= 10)
