"""One writer per run folder: an OS file lock held for a run's lifetime.

`RunLock.acquire` takes an exclusive ``flock`` on ``RUN_DIR/run.lock`` (creating the folder
when needed) and writes the holder's pid and host into it. The OS releases the lock when the
process ends in any way (exit, a signal, kill -9), so a dead run never leaves a stale lock: a
lock file whose process is gone is simply taken again. A second run on the same folder — fresh
or ``--resume`` — is refused with a one-line `RlttError` naming the folder and the holder's pid
before it writes anything (opening the existing lock file to try the lock writes nothing).

The lock file may be unlinked: `release` removes a folder it created that holds nothing else (a
run refused before it wrote anything). A process that opened that file just before can then lock
the unlinked inode while a third creates a new ``run.lock`` and locks that — two writers. So
`acquire` checks, once it holds the ``flock``, that its descriptor is still the file at the path
(same device and inode) and otherwise closes it and tries the path's current file again.

Within one process the lock is shared: a loop that rebuilds its parts (a Ray learner restart)
or a test that builds two runs on one folder takes it again without conflict. Under torchrun
only rank 0 takes it; under Ray the driver does.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from rltt.errors import RlttError

LOCK_FILE = "run.lock"

#: folder (resolved) -> [fd, holders] for the locks this process holds
_held: dict[Path, list[int]] = {}


def _holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").split()
    except OSError:
        return "another process"
    pid = text[0] if text else "?"
    host = f" on {text[1]}" if len(text) > 1 and text[1] != socket.gethostname() else ""
    return f"pid {pid}{host}"


#: how often `acquire` retries when the lock file at the path is replaced while it locks
_ATTEMPTS = 50


def _lock(path: Path, run_dir: Path, key: str) -> int | None:
    """An exclusively ``flock``ed descriptor of ``path`` (created with its folder when absent), None
    when the file vanished before it could be opened, or a one-line `RlttError` when it is held."""
    fd = None
    try:
        if path.exists():  # try the holder's file first: nothing is written unless the lock is ours
            fd = os.open(path, os.O_RDWR)
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        raise RlttError(f"{key}: {run_dir} is in use by another run ({_holder(path)}); wait for it to end, "
                        f"stop it, or choose another {key}") from None
    except FileNotFoundError:
        if fd is not None:
            os.close(fd)
        return None
    except OSError as exc:
        if fd is not None:
            os.close(fd)
        raise RlttError(f"{key}: cannot lock {path} ({exc.strerror or type(exc).__name__})") from None


def _is_path(fd: int, path: Path) -> bool:
    """Whether the open descriptor ``fd`` is still the file at ``path`` (same device and inode)."""
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)


class RunLock:
    """The lock on one run folder (`acquire`; `release` — also when the process dies)."""

    def __init__(self, run_dir: Path, created: bool):
        self.run_dir, self.created = run_dir, created
        self.released = False

    @classmethod
    def acquire(cls, run_dir: str | Path, key: str = "logging.run_dir") -> "RunLock":
        """Lock ``run_dir`` for this process, or a one-line `RlttError` naming the holder."""
        run_dir = Path(run_dir).expanduser()
        root = run_dir.resolve()
        if root in _held:
            _held[root][1] += 1
            return cls(run_dir, created=False)
        path = run_dir / LOCK_FILE
        for _ in range(_ATTEMPTS):
            created = not run_dir.exists()
            fd = _lock(path, run_dir, key)
            if fd is None:  # the file vanished between looking and opening: look again
                continue
            if _is_path(fd, path):
                break
            os.close(fd)  # we locked a file that was unlinked or replaced meanwhile: not the run's lock
        else:
            raise RlttError(f"{key}: cannot lock {path} (its lock file kept being replaced; is another run "
                            "starting and stopping on this folder?)")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        _held[root] = [fd, 1]
        return cls(run_dir, created)

    def release(self) -> None:
        """Give the lock up (once). A folder this lock created that holds nothing else (a run
        refused before it wrote anything) is removed again."""
        if self.released:
            return
        self.released = True
        root = self.run_dir.resolve()
        held = _held.get(root)
        if held is None:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _held[root]
        try:
            if self.created and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
                (self.run_dir / LOCK_FILE).unlink()
                self.run_dir.rmdir()
        except OSError:
            pass
        os.close(held[0])  # closing the descriptor releases the lock
