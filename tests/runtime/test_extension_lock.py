"""A torch-extension build lock left by a killed builder is cleared; a live one is waited for."""

import os
import signal
import subprocess
import sys
import time

from torch.utils.file_baton import FileBaton

from rltt.runtime.extension_lock import STALE_S, build_dir, clear_stale_build_lock

NAME = "deepspeed_shm_comm"

HOLDER = """
import sys, time
from torch.utils.file_baton import FileBaton
baton = FileBaton(sys.argv[1])
assert baton.try_acquire()
print("held", flush=True)
time.sleep(600)  # killed while "building"
"""


def test_a_killed_builders_lock_is_cleared_once_stale(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = build_dir(NAME)
    assert folder.is_relative_to(tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock.exists() and not FileBaton(str(lock)).try_acquire()  # torch would wait for it forever

    assert not clear_stale_build_lock(NAME)  # young: a build may still be running, so it is left
    assert lock.exists()
    assert clear_stale_build_lock(NAME, now=time.time() + STALE_S + 1)
    assert not lock.exists()
    assert "stale build lock" in capsys.readouterr().err
    baton = FileBaton(str(lock))
    assert baton.try_acquire()  # the next build can start
    baton.release()


def test_no_lock_and_an_old_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not clear_stale_build_lock(NAME)
    lock = build_dir(NAME) / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    old = time.time() - STALE_S - 5
    os.utime(lock, (old, old))
    assert clear_stale_build_lock(NAME) and not lock.exists()
