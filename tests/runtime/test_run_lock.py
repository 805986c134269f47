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


HOLD_THEN_RELEASE = """
import sys
from rltt.runtime.run_lock import RunLock
lock = RunLock.acquire(sys.argv[1])
print("locked", flush=True)
sys.stdin.readline()
lock.release()
print("released", flush=True)
"""


def test_an_opener_racing_a_release_and_a_third_run_never_makes_two_writers(tmp_path, monkeypatch):
    """A holder that created the folder releases it (unlinking ``run.lock`` and removing the folder)
    between our open and our ``flock``, and a third run then creates and locks a new ``run.lock``: the
    inode we lock is no longer the path's, so we must look again and be refused — not hold a lock
    on an unlinked file beside the third run's."""
    import fcntl

    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-c", HOLD_THEN_RELEASE, str(run)], env=worker_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert first.stdout.readline().strip() == "locked"
    procs, real_flock = [first], fcntl.flock

    def racing_flock(fd, op):
        if len(procs) == 1:  # between our open and our lock: the holder leaves, a third run arrives
            first.stdin.write("\n")
            first.stdin.flush()
            assert first.stdout.readline().strip() == "released" and first.wait(timeout=60) == 0
            assert not run.exists()  # the holder created the folder and removed it again
            procs.append(_holder(run))
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", racing_flock)
    try:
        with pytest.raises(RlttError) as info:
            RunLock.acquire(run)
        assert f"pid {procs[1].pid}" in str(info.value)  # refused by the third run's lock, which it names
        assert (run / LOCK_FILE).read_text().split()[0] == str(procs[1].pid)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_racing_processes_never_hold_one_folder_at_once(tmp_path):
    """Processes that take and give up the lock of a folder they create, over and over: each marks
    its tenure with an exclusively created file, which a second writer would find already there."""
    script = """
import os, sys
from rltt.errors import RlttError
from rltt.runtime.run_lock import RunLock
run, marker, held, tries = sys.argv[1], sys.argv[2], 0, 0
while (tries < 150 or not held) and tries < 20000:  # at least 150 tries, and on until this one held it
    tries += 1
    try:
        lock = RunLock.acquire(run)
    except RlttError:
        continue
    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # FileExistsError: two writers
    os.close(fd)
    os.unlink(marker)
    held += 1
    lock.release()
print(held)
"""
    run, marker = tmp_path / "run", tmp_path / "marker"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(run), str(marker)], env=worker_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert int(out) > 0
