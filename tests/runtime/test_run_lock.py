"""`rltt.runtime.run_lock`: one writer per run folder, across real processes; a lock file left by
a killed process is no lock."""

import os
import signal
import subprocess
import sys

import pytest

from rltt.errors import RlttError
from rltt.runtime.run_lock import LOCK_FILE, RunLock

from ..subprocess_env import worker_env

HOLD = """
import sys, time
from rltt.runtime.run_lock import RunLock
RunLock.acquire(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def _holder(run_dir) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=worker_env(), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_process_is_refused_with_the_holder_then_a_killed_holder_leaves_no_lock(tmp_path):
    run = tmp_path / "run"
    proc = _holder(run)
    try:
        before = (run / LOCK_FILE).read_bytes()
        with pytest.raises(RlttError) as info:
            RunLock.acquire(run)
        message = str(info.value)
        assert "\n" not in message and str(run) in message and f"pid {proc.pid}" in message
        assert (run / LOCK_FILE).read_bytes() == before  # the refused one wrote nothing
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (run / LOCK_FILE).read_text().split()[0] == str(proc.pid)  # stale file, no lock
    lock = RunLock.acquire(run)
    assert (run / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    lock.release()
    assert (run / LOCK_FILE).exists()  # a folder that held a run keeps its lock file


def test_one_process_may_take_its_own_lock_again(tmp_path):
    first = RunLock.acquire(tmp_path / "run")
    second = RunLock.acquire(tmp_path / "run")
    second.release()
    proc = subprocess.run([sys.executable, "-c", HOLD, str(tmp_path / "run")], env=worker_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "is in use by another run" in proc.stderr  # still held by the first
    first.release()
    assert not (tmp_path / "run").exists()  # created by the lock, nothing else written: removed again
