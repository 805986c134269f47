"""Run a tool's Python code in a fresh, limited, throw-away interpreter (docs/tools.md).

Every call starts its own process — ``sys.executable -I -S -B -X utf8 -c _CHILD`` — in a new
session (its own process group), with a scrubbed environment and ``cwd`` = a fresh scratch folder
that is deleted afterwards. Nothing survives from one call to the next: no interpreter state, no
files, no resource usage. (A pool of warm workers, as `rltt.data.reward_pool` keeps for reward
functions, would carry one call's state and lowered limits into the next; tool code is written
by the policy, so each call gets a process of its own.)

Inside the child, before the code runs (`_CHILD`, in this order):

1. the code is read from stdin, which is then ``/dev/null``;
2. network: ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` puts the process in an empty network
   namespace (no interface but a down loopback) when the kernel permits it — a kernel boundary;
3. the process asks the kernel to kill it when its parent dies (``PR_SET_PDEATHSIG``);
4. Landlock (Linux >= 5.13, when enabled): the kernel lets the process open files only in the
   scratch folder (any access), the interpreter's library folders and system libraries (read)
   and ``/dev/null``; nothing can be executed; TCP bind/connect are refused (Landlock ABI >= 4);
   signals and abstract unix sockets cannot reach any process outside (ABI >= 6) — kernel
   boundaries, with ``no_new_privs`` set;
5. resource limits: ``RLIMIT_CPU`` (soft = ``ceil(cpu_s)``, hard one second later),
   ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (largest file it may write),
   ``RLIMIT_NPROC`` = 0 (no new processes or threads; the kernel does not apply it to uid 0),
   ``RLIMIT_NOFILE`` and ``RLIMIT_CORE`` = 0;
6. an audit hook (`sys.addaudithook`) refuses sockets, ctypes, new processes, signals to other
   processes, changing limits, writes outside the scratch folder and reads outside it and the
   interpreter's own library folders, and records each refusal so the call counts as
   ``forbidden`` even when the code catches the error. The hook is a guard that names what was
   refused, **not a security boundary**: C code reached without an audit event (or a bug in
   the interpreter) gets past it; steps 2 and 4 are what the kernel enforces.

`isolation()` says which layers apply on the machine at hand.

The parent reads stdout and stderr (one pipe, so they interleave as on a terminal) into a
bounded head/tail buffer while it waits, kills the whole process group at the wall-clock
timeout, and classifies the outcome as one of `ERRORS`.
"""

from __future__ import annotations

import ast
import codecs
import math
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

from rltt.environments import syscall_filter

#: The kinds of failure a sandboxed call reports (``SandboxRun.error``), with what each means.
ERRORS = {
    "timeout": "the wall-clock limit passed; the process group was killed",
    "cpu": "the CPU-time limit (RLIMIT_CPU) killed the process",
    "memory": "an allocation failed under the address-space limit (MemoryError)",
    "crash": "the process died from a signal (a segfault, an abort, a kill)",
    "exit": "the code exited with a non-zero status (sys.exit(n), os._exit(n))",
    "exception": "the code raised an exception it did not catch (the traceback is in the output)",
    "syntax": "the code does not compile",
    "forbidden": "the code tried something the sandbox refuses (network, files outside its "
                 "folder, processes, signals, ctypes, limits)",
    "too_long": "the source is longer than MAX_SOURCE_CHARS",
    "sandbox": "the sandbox itself failed to start or to report",
}
#: Longest source a call accepts (it is sent through a pipe that holds 64 KiB without blocking).
MAX_SOURCE_CHARS = 16_000
#: Largest file the code may write (RLIMIT_FSIZE), and how many files it may hold open.
FILE_SIZE_MB = 64
OPEN_FILES = 64

# Child-side code. Kept to builtins and small extension modules so a call starts fast; it talks
# to the parent through a status pipe: one ``repr((kind, message, network, [first refusal],
# landlock ABI))`` record. The CPU limit's hard value is one second past the soft one (SIGXCPU).
_CHILD = r'''
import os, sys
def _main():
    status_fd, cpu_s, memory_mb, fsize_mb, nofile = (int(a) for a in sys.argv[1:6])
    scratch, net_mode, want_landlock, hook_on = sys.argv[6], sys.argv[7], *(a == "1" for a in sys.argv[8:10])
    confined = sys.argv[10] == "1"  # in bubblewrap's namespaces: the scratch folder is a tmpfs of its own
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout.reconfigure(line_buffering=True, errors="backslashreplace")
    sys.stderr.reconfigure(line_buffering=True, errors="backslashreplace")
    status = os.fdopen(status_fd, "w", encoding="utf-8")

    network = "namespace" if net_mode == "given" else "none"
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if net_mode == "1":
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(0x10000000 | 0x40000000) == 0:  # CLONE_NEWUSER | CLONE_NEWNET
            try:
                for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                                   ("gid_map", f"{gid} {gid} 1")):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
                network = "namespace"
            except OSError:
                network = "namespace-unmapped"
    if hasattr(libc, "prctl"):  # Linux
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
        if os.getppid() == 1 and not confined:  # (confined, pid 1 is the namespace's init)
            os._exit(70)
    landlock = _landlock(ctypes, libc, scratch) if want_landlock else 0
    for name in ("ctypes", "_ctypes", "ctypes._endian"):
        sys.modules.pop(name, None)
    del ctypes, libc

    import resource, _signal  # (not signal: it imports enum, a tenth of the start-up)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)  # a too-large write raises OSError(EFBIG)
    limits = [(resource.RLIMIT_CPU, cpu_s, cpu_s + 1), (resource.RLIMIT_AS, memory_mb << 20, memory_mb << 20),
              (resource.RLIMIT_FSIZE, fsize_mb << 20, fsize_mb << 20), (resource.RLIMIT_NOFILE, nofile, nofile),
              (resource.RLIMIT_CORE, 0, 0), (resource.RLIMIT_NPROC, 0, 0)]
    for which, soft, hard in limits:
        old_soft, old_hard = resource.getrlimit(which)
        if old_hard != resource.RLIM_INFINITY:
            hard = min(hard, old_hard)
        try:
            resource.setrlimit(which, (min(soft, hard), hard))
        except (ValueError, OSError):  # a platform without this limit (RLIMIT_AS on macOS)
            if sys.platform.startswith("linux"):
                raise

    violations = []
    if hook_on:
        _install_hook(scratch, violations)

    def report(kind, message=""):
        disk = -1
        if confined:
            try:
                st = os.statvfs(scratch)
                disk = (st.f_blocks - st.f_bfree) * st.f_frsize
            except OSError:
                pass
        for stream in (sys.stdout, sys.stderr):  # all output is in the pipe before the record
            try:
                stream.flush()
            except Exception:
                pass
        status.write(repr((kind, message, network, violations[:1], landlock, disk)))
        status.flush()

    import _ast
    try:
        tree = compile(code, "<tool>", "exec", _ast.PyCF_ONLY_AST)
        last = None
        if tree.body and isinstance(tree.body[-1], _ast.Expr):
            last = compile(_ast.Expression(body=tree.body.pop().value), "<tool>", "eval")
        body = compile(tree, "<tool>", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        import traceback
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        return report("syntax", f"{type(exc).__name__}: {exc}")
    sys.argv = ["<tool>"]
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(body, scope)
        if last is not None:
            value = eval(last, scope)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        code_ = exc.code
        if code_ is None or code_ == 0:
            return report("ok")
        if not isinstance(code_, int):
            print(code_, file=sys.stderr)
            code_ = 1
        return report("exit", f"exit status {code_}")
    except BaseException as exc:
        try:
            import linecache  # the traceback shows the code's lines
            linecache.cache["<tool>"] = (len(code), None, code.splitlines(True), "<tool>")
            sys.stderr.write(_format_exception(exc))
        except BaseException:
            sys.stderr.write(f"{type(exc).__name__}\n")
        if getattr(exc, "_rltt_sandbox", False):
            return report("forbidden", str(exc))
        if isinstance(exc, MemoryError):
            return report("memory", "MemoryError")
        return report("exception", f"{type(exc).__name__}: {exc}"[:200])
    report("ok")


def _landlock(ctypes, libc, scratch):
    """Landlock (Linux >= 5.13): from here on the kernel lets this process open files only in
    the scratch folder (any access), the interpreter's library folders and system libraries
    (read), and a few devices; TCP bind/connect are refused (ABI >= 4); signals and abstract
    unix sockets cannot reach processes outside (ABI >= 6). Returns the ABI applied, 0 if none."""
    import struct, stat
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    abi = syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return 0
    fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    file_rights = (1 | 2 | 4 | (1 << 14) | (1 << 15)) & fs  # execute, write, read, truncate, ioctl
    read = 4 | 8  # READ_FILE | READ_DIR
    fields = [fs] + ([3] if abi >= 4 else []) + ([3] if abi >= 6 else [])  # TCP bind+connect; signal+unix scopes
    attr = struct.pack(f"{len(fields)}Q", *fields)
    ruleset = syscall(444, ctypes.create_string_buffer(attr, len(attr)), ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    roots = [p for p in sys.path if p] + ["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib",
                                          "/usr/share/zoneinfo", "/etc/ld.so.cache", "/etc/localtime",
                                          "/dev/zero", "/dev/urandom", "/dev/random"]
    rules = [(scratch, fs), ("/dev/null", 2 | 4)] + [(p, read) for p in roots]
    try:
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= file_rights
                rule = struct.pack("=Qi", access, fd)  # struct landlock_path_beneath_attr (packed)
                if syscall(445, ruleset, 1, ctypes.create_string_buffer(rule, len(rule)), 0) != 0:
                    return 0
            finally:
                os.close(fd)
        if libc.prctl(38, 1, 0, 0, 0) != 0 or syscall(446, ruleset, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return 0
        return abi
    finally:
        os.close(ruleset)


def _format_exception(exc):
    """The traceback as Python prints it, without this bootstrap's frames (file "<string>")."""
    import traceback
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen = set()
    stack = [te]
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        t.stack = traceback.StackSummary.from_list([f for f in t.stack if f.filename != "<string>"])
        stack += [c for c in (t.__cause__, t.__context__) if c is not None]
    return "".join(te.format())


class SandboxViolation(PermissionError):
    """Raised by the audit hook for an operation the sandbox refuses."""
    _rltt_sandbox = True


def _install_hook(scratch, violations):
    import posixpath, posix, _posixsubprocess
    realpath, join, isabs, isdir = posixpath.realpath, posixpath.join, posixpath.isabs, posixpath.isdir
    scratch = realpath(scratch)
    read_roots = tuple({realpath(p) for p in sys.path if p} | {scratch, "/usr/share/zoneinfo"})
    read_files = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
    write_files = ("/dev/null",)
    getpid, getpgrp, readlink, fsdecode = os.getpid, os.getpgrp, os.readlink, os.fsdecode
    O_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    busy = []

    def deny(what):
        if not violations:
            violations.append(what)
        raise SandboxViolation(f"sandbox: {what} is not allowed")

    def resolve(path, dir_fd=None):
        path = fsdecode(path)
        if not isabs(path) and isinstance(dir_fd, int) and dir_fd >= 0:
            path = join(readlink(f"/proc/self/fd/{dir_fd}"), path)
        return realpath(path)

    def inside(path, roots):
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    def check_write(path, dir_fd=None, what="writing"):
        if isinstance(path, int) or path is None:
            return
        full = resolve(path, dir_fd)
        if full not in write_files and not inside(full, (scratch,)):
            deny(f"{what} {full!r} (outside the tool's folder)")

    def check_read(path, dir_fd=None, what="reading"):
        if isinstance(path, int) or path is None:
            return
        full = resolve(path, dir_fd)
        if full not in read_files and not inside(full, read_roots):
            deny(f"{what} {full!r}")

    def on_open(args):
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & O_WRITE)
        (check_write if writes else check_read)(path)
        # a folder's descriptor outside the scratch folder could serve as the dir_fd of a later
        # os.open, whose audit event does not carry it: refuse the descriptor
        if not isinstance(path, int) and path is not None:
            full = resolve(path)
            if isdir(full) and not inside(full, (scratch,)):
                deny(f"opening the folder {full!r}")

    def kill(args):
        if args[0] not in (0, getpid()):
            deny(f"signalling process {args[0]}")

    def killpg(args):
        if args[0] not in (0, getpgrp()):
            deny(f"signalling process group {args[0]}")

    def dir_fd_of(args, index):
        return args[index] if len(args) > index else None

    checks = {
        "open": on_open,
        "os.listdir": lambda a: check_read(a[0], what="listing"),
        "os.scandir": lambda a: check_read(a[0], what="listing"),
        "os.remove": lambda a: check_write(a[0], dir_fd_of(a, 1), "removing"),
        "os.rmdir": lambda a: check_write(a[0], dir_fd_of(a, 1), "removing"),
        "os.mkdir": lambda a: check_write(a[0], dir_fd_of(a, 2), "creating"),
        "os.chmod": lambda a: check_write(a[0], dir_fd_of(a, 2), "changing the mode of"),
        "os.chown": lambda a: check_write(a[0], dir_fd_of(a, 3), "changing the owner of"),
        "os.utime": lambda a: check_write(a[0], dir_fd_of(a, 3), "changing the times of"),
        "os.truncate": lambda a: check_write(a[0], None, "truncating"),
        "os.mkfifo": lambda a: check_write(a[0], dir_fd_of(a, 2), "creating"),
        "os.mknod": lambda a: check_write(a[0], dir_fd_of(a, 3), "creating"),
        "os.setxattr": lambda a: check_write(a[0], None, "changing attributes of"),
        "os.removexattr": lambda a: check_write(a[0], None, "changing attributes of"),
        "os.rename": lambda a: (check_write(a[0], a[2], "renaming"), check_write(a[1], a[3], "renaming to")),
        "os.link": lambda a: (check_write(a[0], a[2], "linking"), check_write(a[1], a[3], "linking to")),
        "os.symlink": lambda a: check_write(a[1], dir_fd_of(a, 2), "creating a link at"),
        "shutil.rmtree": lambda a: check_write(a[0], dir_fd_of(a, 1), "removing"),
        "sqlite3.connect": lambda a: None if str(a[0]) in (":memory:", "") else check_write(a[0], None, "opening a database at"),
        "os.kill": kill,
        "os.killpg": killpg,
        # ctypes; and a second copy of the modules patched below
        "import": lambda a: deny(f"importing {a[0]}") if a[0].partition(".")[0] in (
            "ctypes", "_ctypes", "_posixsubprocess", "posix") else None,
    }
    refused = {"os.system": "running a shell command", "os.exec": "exec'ing a program",
               "os.posix_spawn": "starting a process", "os.spawn": "starting a process",
               "os.fork": "starting a process", "os.forkpty": "starting a process",
               "subprocess.Popen": "starting a process", "pty.spawn": "starting a process",
               "resource.setrlimit": "changing resource limits", "resource.prlimit": "changing resource limits",
               "os.setuid": "changing user", "os.chroot": "chroot"}

    def hook(event, args):
        if busy:
            return
        check = checks.get(event)
        what = refused.get(event)
        if check is None and what is None:
            if event.startswith("socket."):
                what = f"network access ({event})"
            elif event.startswith("ctypes."):
                what = f"ctypes ({event})"
            else:
                return
        busy.append(1)
        try:
            if what is not None:
                deny(what)
            try:
                check(args)
            except SandboxViolation:
                raise
            except Exception:  # arguments this checker cannot read: refuse rather than guess
                deny(f"{event} (its arguments could not be checked)")
        finally:
            busy.pop()

    # process starts and signals that raise no audit event: subprocess's C helper, pidfds
    def fork_exec(*args, **kwargs):
        deny("starting a process")

    _posixsubprocess.fork_exec = fork_exec
    if hasattr(posix, "pidfd_open"):
        real_pidfd_open = posix.pidfd_open

        def pidfd_open(pid, flags=0):
            if pid != getpid():
                deny(f"signalling process {pid}")
            return real_pidfd_open(pid, flags)

        posix.pidfd_open = os.pidfd_open = pidfd_open
    sys.addaudithook(hook)

_main()
sys.stdout.flush()
sys.stderr.flush()
'''


@dataclass(frozen=True)
class SandboxRun:
    """What one sandboxed call produced: its captured output, truncated to the budget (with a
    note appended on failures), the failure kind (a key of `ERRORS`) or None, and how it ran."""

    output: str
    error: str | None
    seconds: float
    exit_code: int | None = None   # the process's status (negative: the signal that ended it)
    network: str = "unknown"        # "namespace": it ran in an empty network namespace; "none": it did not
    landlock: int = 0               # the Landlock ABI that confined it (0: none)
    confined: bool = False          # it ran in bubblewrap's namespaces under the seccomp filter
    disk_bytes: int = -1            # what its scratch tmpfs held at the end (-1: not known, or not confined)


# -- output capture ---------------------------------------------------------------------------

def truncate(text: str, budget: int) -> str:
    """``text`` if it fits ``budget`` characters, else its head and tail around a marker saying how
    much was cut; the result is never longer than ``budget``."""
    if len(text) <= budget:
        return text
    return _cut(text[:budget], text[-budget:], len(text), budget)


def _marker(cut: int, total: int) -> str:
    return f"\n[... output truncated: {cut} of {total} characters cut ...]\n"


def _cut(head: str, tail: str, total: int, budget: int) -> str:
    keep = max(0, budget - len(_marker(total, total)))
    head_n = keep - keep // 2
    tail_n = keep // 2
    text = head[:head_n] + _marker(total - keep, total) + (tail[-tail_n:] if tail_n else "")
    return text[:budget]


class _Capture:
    """UTF-8 output kept as its first and last ``budget`` characters, and its length."""

    def __init__(self, budget: int):
        self.budget = budget
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.head = ""
        self.tail = ""
        self.total = 0

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self.decoder.decode(data, final)
        self.total += len(text)
        if len(self.head) < self.budget:
            self.head += text[: self.budget - len(self.head)]
        self.tail = (self.tail + text)[-self.budget:]

    def text(self, budget: int) -> str:
        if self.total <= budget:  # budget <= self.budget: the head holds it all
            return self.head
        return _cut(self.head, self.tail, self.total, budget)


# -- the parent side --------------------------------------------------------------------------

def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _classify(exit_code: int, status: tuple | None, timed_out: bool, cpu_used: float,
              limits: tuple[float, float, int]) -> tuple[str | None, str]:
    """``(kind, message)`` of a finished child."""
    timeout_s, cpu_s, memory_mb = limits
    if timed_out:
        return "timeout", f"timed out after {timeout_s:g} s (the process was killed)"
    if status is not None:
        kind, message = status[0], status[1]
        if status[3] and kind in ("ok", "exit", "exception"):  # a refusal the code caught or wrapped
            return "forbidden", f"sandbox: {status[3][0]} is not allowed"
        if kind == "ok":
            return (None, "") if exit_code == 0 else ("exit", f"exit status {exit_code}")
        if kind in ERRORS:
            if kind == "memory":
                message = f"MemoryError: the address-space limit is {memory_mb} MB"
            return kind, message
    if exit_code < 0:
        signum = -exit_code
        if signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu_used >= math.ceil(cpu_s)):
            return "cpu", f"CPU-time limit of {math.ceil(cpu_s)} s exceeded (killed by {_signal_name(signum)})"
        return "crash", f"killed by {_signal_name(signum)}"
    if exit_code == 0:
        return "sandbox", "the process ended without reporting a result"
    return "exit", f"exit status {exit_code}"


_NOTE_KINDS = {"timeout", "cpu", "crash", "exit", "forbidden", "too_long", "sandbox", "memory"}


def _finish(capture: _Capture | None, output: str, kind: str | None, message: str, budget: int) -> str:
    """The output the model sees: the program's output within the budget, and on a failure
    without a traceback of its own a last line naming it (the note always fits)."""
    note = f"[{kind}: {message}]" if kind in _NOTE_KINDS else ""
    if note and len(note) > budget // 2:
        note = note[: budget // 2 - 4] + "...]"
    room = budget - (len(note) + 1 if note else 0)
    body = capture.text(room) if capture is not None else truncate(output, room)
    if not note:
        return body
    return f"{body}\n{note}" if body and not body.endswith("\n") else f"{body}{note}"


def _child_env(scratch: str) -> dict[str, str]:
    return {"PATH": os.defpath, "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# -- scratch folders of unconfined calls ------------------------------------------------------

_SCRATCH_PREFIX = "rltt-tool-"


def _remove_tree(path: str) -> None:
    """Remove ``path`` and everything in it; never raises and never recurses (the code made the
    tree: it may be thousands of folders deep, or read-only). Folders are moved up to ``path``'s
    level one at a time and emptied there, so at most two descriptors are open and no path
    grows longer than a name."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    counter = 0
    try:
        while True:
            try:
                names = os.listdir(top)
            except OSError:
                break
            if not names:
                break
            progress = False
            for name in names:
                removed = _unlink(name, top)
                if removed:
                    progress = True
                    continue
                if removed is False and not _is_dir(name, top):
                    continue
                try:
                    os.rmdir(name, dir_fd=top)
                    progress = True
                    continue
                except OSError:
                    pass
                try:  # a folder with entries: its sub-folders move up, its files go
                    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                except OSError:
                    continue
                try:
                    for inner in os.listdir(fd):
                        if not _unlink(inner, fd):
                            counter += 1
                            try:
                                os.rename(inner, f".rm{counter}", src_dir_fd=fd, dst_dir_fd=top)
                            except OSError:
                                continue
                        progress = True
                except OSError:
                    pass
                finally:
                    os.close(fd)
            if not progress:
                break
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        pass


def _unlink(name: str, dir_fd: int) -> bool | None:
    """Make ``name`` (in the folder ``dir_fd``) writable and unlink it: True when it went, None when it
    is a folder, False when it could not go for another reason."""
    try:
        os.chmod(name, 0o700, dir_fd=dir_fd, follow_symlinks=False)
    except (OSError, NotImplementedError):  # a symlink cannot be chmod-ed here: the unlink below decides
        pass
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except IsADirectoryError:
        return None
    except OSError:
        return False


def _is_dir(name: str, dir_fd: int) -> bool:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode & 0o170000 == 0o040000
    except OSError:
        return False


@lru_cache(maxsize=None)
def sweep_stale_scratch() -> int:
    """Remove the scratch folders that calls of processes no longer running left behind (a killed
    trainer cannot clean up); once per process, before its first unconfined call. Returns how
    many were removed."""
    removed = 0
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(_SCRATCH_PREFIX):
            continue
        pid = name[len(_SCRATCH_PREFIX):].partition("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        _remove_tree(os.path.join(root, name))
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the kernel layers: bubblewrap and the seccomp filter -------------------------------------

#: Largest total the scratch folder of a confined call may hold (a tmpfs of this size: it lives in
#: memory and goes with the call's namespace). Above `FILE_SIZE_MB`, so a file at that limit fits.
SCRATCH_MB = 2 * FILE_SIZE_MB
#: The uid and gid tool code runs as inside its user namespace (``nobody``).
SANDBOX_UID = 65534
#: Where the scratch tmpfs is mounted inside the namespace (empty at the start of each call; /tmp
#: is an empty read-only folder, so a path under the host's /tmp never looks like the scratch's).
CONFINED_SCRATCH = "/scratch"
_SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/lib", "/lib64", "/lib32", "/usr/lib32")
_SYSTEM_FILES = ("/usr/share/zoneinfo", "/etc/ld.so.cache", "/etc/localtime")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
#: What to install when bubblewrap is missing (the refusal says it).
INSTALL_HINT = ("install bubblewrap and libseccomp (Debian/Ubuntu: apt-get install bubblewrap libseccomp2; "
                "Fedora: dnf install bubblewrap libseccomp; or scripts/install_system_deps.sh as root) and allow "
                "unprivileged user namespaces (in Docker: options like --security-opt seccomp=unconfined "
                "--security-opt systempaths=unconfined)")


def bwrap_path() -> str | None:
    """The bubblewrap executable (``bwrap`` on PATH, or /usr/bin/bwrap), None when not installed."""
    found = shutil.which("bwrap")
    if found is None and os.access("/usr/bin/bwrap", os.X_OK):
        found = "/usr/bin/bwrap"
    return found


def _interpreter(site_packages: bool) -> str:
    # without site-packages, the real file (a venv's python is a link whose pyvenv.cfg is outside the view)
    return sys.executable if site_packages else os.path.realpath(sys.executable)


def _bwrap_args(bwrap: str, site_packages: bool, seccomp_fd: int | None) -> list[str]:
    """bubblewrap's command line (`_view_args`) with the seccomp program read from ``seccomp_fd``."""
    return [*_view_args(bwrap, site_packages), *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else [])]


@lru_cache(maxsize=None)
def _view_args(bwrap: str, site_packages: bool) -> tuple[str, ...]:
    """bubblewrap's command line: new user (uid `SANDBOX_UID`, no capabilities), PID, mount,
    network, IPC, UTS and cgroup namespaces; a read-only root holding only the interpreter, its
    libraries and a few devices; a fresh ``/proc``; an empty ``/tmp``; the scratch folder
    `CONFINED_SCRATCH`, a tmpfs of `SCRATCH_MB`; the seccomp filter last, just before the
    interpreter starts."""
    args = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
            "--die-with-parent", "--cap-drop", "ALL"]  # (a session of its own: Popen start_new_session)
    bound: list[str] = []

    def ro(path: str) -> None:
        real = os.path.realpath(path)
        if any(real == b or real.startswith(b.rstrip("/") + "/") for b in bound) or not os.path.exists(real):
            return
        args.extend(["--ro-bind", real, real])
        bound.append(real)

    for lib in _SYSTEM_LIBS:
        if os.path.islink(lib):
            args.extend(["--symlink", os.readlink(lib), lib])
        elif os.path.isdir(lib):
            ro(lib)
    ro(sys.base_prefix)
    executable = _interpreter(site_packages)
    ro(os.path.realpath(executable))
    if site_packages:
        ro(sys.prefix)  # a venv: its links to the interpreter and its site-packages
    for path in _SYSTEM_FILES:
        if os.path.exists(path):
            ro(path)
    for device in _DEVICES:
        if os.path.exists(device):
            args.extend(["--dev-bind", device, device])
    args.extend(["--proc", "/proc", "--dir", "/tmp", "--size", str(SCRATCH_MB << 20), "--tmpfs", CONFINED_SCRATCH,
                 "--chdir", CONFINED_SCRATCH, "--remount-ro", "/"])
    return tuple(args)


def _filter_fd() -> int | None:
    """A pipe's read end holding the seccomp program (bubblewrap reads it once), or None."""
    program = syscall_filter.program()
    if program is None:
        return None
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, program)  # ~1 KB: the pipe holds it
    finally:
        os.close(write_fd)
    return read_fd


# -- running a call ---------------------------------------------------------------------------

def run_python(source: str, *, timeout_s: float = 5.0, cpu_s: float = 5.0, memory_mb: int = 512,
               output_chars: int = 1024, site_packages: bool = False, _audit_hook: bool = True,
               _namespaces: bool = True, _seccomp: bool = True) -> SandboxRun:
    """Run ``source`` as a script in a fresh sandboxed interpreter (see the module docstring).

    The output is stdout and stderr interleaved, at most ``output_chars`` characters (head and
    tail around a marker when longer). If the last statement is an expression whose value is
    not None, its ``repr`` is printed, as in a notebook cell. ``site_packages=True`` lets the code
    import the environment's installed packages (read-only), not just the standard library.
    Tests only: ``_audit_hook=False`` leaves out the audit-hook guard, ``_namespaces=False``
    bubblewrap (and with it the seccomp filter), ``_seccomp=False`` the seccomp filter alone, to
    check each remaining layer by itself.

    Never raises on what the code did: whatever goes wrong is a `SandboxRun` with an error kind.
    """
    start = time.monotonic()
    if len(source) > MAX_SOURCE_CHARS:
        kind, message = "too_long", f"the code has {len(source)} characters; the limit is {MAX_SOURCE_CHARS}"
        return SandboxRun(_finish(None, "", kind, message, output_chars), kind, time.monotonic() - start)
    limits = (timeout_s, cpu_s, memory_mb, output_chars, site_packages, _audit_hook)
    try:
        if _namespaces and confinement().ok:
            return _run_in(None, source, start, *limits, seccomp=_seccomp)
        sweep_stale_scratch()
        scratch = tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-")
        try:
            return _run_in(scratch, source, start, *limits, seccomp=False)
        finally:
            _remove_tree(scratch)
    except Exception as exc:  # a failure of the sandbox's own, whatever the code did: a tool error
        kind, message = "sandbox", f"the sandbox failed: {type(exc).__name__}: {exc}"[:300]
        return SandboxRun(_finish(None, "", kind, message, output_chars), kind, time.monotonic() - start)


def _run_in(scratch, source, start, timeout_s, cpu_s, memory_mb, output_chars, site_packages, audit_hook,
            seccomp):
    """One call: in bubblewrap's namespaces when ``scratch`` is None, else in the host's with
    ``scratch`` as its folder."""
    confined = scratch is None
    status_r, status_w = os.pipe()
    cpu_limit = max(1, math.ceil(cpu_s))
    flags = ["-I", "-B", "-X", "utf8"] + ([] if site_packages else ["-S"])
    net_mode = "given" if confined else ("1" if network_namespaces() else "0")
    inner_scratch = CONFINED_SCRATCH if confined else scratch
    child = [_interpreter(site_packages) if confined else sys.executable, *flags, "-c", _CHILD, str(status_w),
             str(cpu_limit), str(int(memory_mb)), str(FILE_SIZE_MB), str(OPEN_FILES), inner_scratch, net_mode,
             "1" if landlock_abi() else "0", "1" if audit_hook else "0", "1" if confined else "0"]
    fds = [status_w]
    if confined:
        filter_fd = _filter_fd() if seccomp else None
        fds += [filter_fd] if filter_fd is not None else []
        args = _bwrap_args(confinement().bwrap, site_packages, filter_fd) + ["--", *child]
        cwd = "/"
    else:
        args, cwd = child, scratch
    try:
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                pass_fds=tuple(fds), cwd=cwd, env=_child_env(inner_scratch),
                                start_new_session=True)
    except OSError as exc:
        for fd in fds + [status_r]:
            os.close(fd)
        kind, message = "sandbox", f"could not start the interpreter: {exc}"
        return SandboxRun(_finish(None, "", kind, message, output_chars), kind, time.monotonic() - start)
    for fd in fds:
        os.close(fd)
    capture = _Capture(output_chars)
    status_bytes = bytearray()
    timed_out = False
    try:
        try:
            proc.stdin.write(source.encode("utf-8", "surrogatepass"))  # < 64 KiB: the pipe holds it
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        deadline = start + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            sel.register(status_r, selectors.EVENT_READ)
            open_streams = 2
            while open_streams:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fileobj)
                        open_streams -= 1
                    elif key.fileobj is proc.stdout:
                        capture.feed(data)
                    elif len(status_bytes) < 65536:
                        status_bytes += data
                        # Confined, bubblewrap's own processes hold the pipes open until the
                        # namespaces are torn down (tens of ms): once the record is in, the output
                        # is in the stdout pipe already (the child flushes before it reports)
                        if confined and _parse_status(bytes(status_bytes)) is not None:
                            _drain(proc.stdout.fileno(), capture)
                            open_streams = 0
                            break
    finally:
        status = _parse_status(bytes(status_bytes))
        # Confined, the interpreter's exit status reaches us through bubblewrap only after the
        # namespaces are torn down (tens of ms: the mount namespace waits for an RCU grace period).
        # With a status record the outcome is known: bubblewrap is killed at once (its init dies
        # with it, and the kernel kills what is left in the PID namespace). Without one (a crash,
        # os._exit), wait for the status that says how it ended.
        if confined and not timed_out and status is None:
            _wait_exit(proc.pid, max(0.05, min(1.0, deadline - time.monotonic())))
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the leader is not reaped yet: its group id is still ours
        except (ProcessLookupError, PermissionError):
            pass
        _, wait_status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        proc.stdout.close()
        os.close(status_r)
    capture.feed(b"", final=True)
    exit_code = proc.returncode
    if confined and status is not None and not timed_out:
        exit_code = 0  # (bubblewrap was killed once the record was in; the record says how it ended)
    elif confined and exit_code > 128:  # bubblewrap passes a signal's death on as 128 + the signal
        exit_code = -(exit_code - 128)
    if confined and not status_bytes and exit_code == 1 and capture.head.startswith("bwrap: "):
        kind, message = "sandbox", f"bubblewrap could not set up the call: {capture.head.splitlines()[0][7:]}"
    elif status is None and status_bytes and not timed_out:
        kind, message = "sandbox", "the call's status record could not be read"
    else:
        kind, message = _classify(exit_code, status, timed_out, usage.ru_utime + usage.ru_stime,
                                  (timeout_s, cpu_s, memory_mb))
    output = _finish(capture, "", kind, message, output_chars)
    network, landlock, disk = (status[2], status[4], status[5]) if status is not None else ("unknown", 0, -1)
    return SandboxRun(output, kind, time.monotonic() - start, exit_code, network, landlock, confined, disk)


def _drain(fd: int, capture: _Capture) -> None:
    """Feed ``capture`` what the pipe ``fd`` holds now, without waiting for more."""
    os.set_blocking(fd, False)
    try:
        while data := os.read(fd, 65536):
            capture.feed(data)
    except (BlockingIOError, OSError):
        pass


def _wait_exit(pid: int, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for process ``pid`` to end, without reaping it."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return
    try:
        select.select([fd], [], [], timeout_s)
    finally:
        os.close(fd)


def _parse_status(data: bytes) -> tuple | None:
    """The child's status record, or None when it is missing or not one (the code can write
    anything to the pipe it inherited: any failure to read it is None, never an exception)."""
    try:
        value = ast.literal_eval(data.decode("utf-8", "replace"))
    except Exception:  # SyntaxError, ValueError, TypeError ({[]: 1}), MemoryError, RecursionError...
        return None
    if (isinstance(value, tuple) and len(value) == 6 and all(isinstance(v, str) for v in value[:3])
            and isinstance(value[3], list) and all(isinstance(v, str) for v in value[3])
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value[4:])):
        return value
    return None


# -- what this machine offers -----------------------------------------------------------------

_PROBE = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
abi = max(0, libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
netns = libc.unshare(0x10000000 | 0x40000000) == 0
print(int(netns), abi)
"""


@lru_cache(maxsize=None)
def _probe() -> tuple[bool, int]:
    """(network namespaces permitted, Landlock ABI) of this kernel for an unprivileged process,
    probed once per process in a throw-away child."""
    try:
        out = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE], timeout=30, env=_child_env("/"),
                             capture_output=True, text=True)
        netns, abi = out.stdout.split()
        return netns == "1", int(abi)
    except (OSError, subprocess.SubprocessError, ValueError):
        return False, 0


# Run inside bubblewrap by `confinement`: what the call actually sees, layer by layer.
_CONFINED_PROBE = """
import os, socket
pids = [p for p in os.listdir('/proc') if p.isdigit()]
try:
    socket.socket(socket.AF_UNIX)
    sockets = 1
except PermissionError:
    sockets = 0
print(os.getuid(), len(pids), int(os.path.exists('/run') or os.path.exists('/home')), sockets,
      int(os.listdir('/tmp') == [] and os.listdir('/scratch') == []), int(os.access('/usr/lib', os.W_OK)))
"""


@dataclass(frozen=True)
class Confinement:
    """What a call inside bubblewrap gets on this machine, probed once by running one: ``ok`` when
    the namespaces (PID, mount, user with an unprivileged uid, network) apply; ``seccomp`` when
    the filter refuses a new socket; ``why`` names what is missing."""

    ok: bool
    bwrap: str | None = None
    seccomp: bool = False
    why: str = ""


@lru_cache(maxsize=None)
def confinement() -> Confinement:
    """Probe bubblewrap once per process: run the probe in the namespaces, under the filter."""
    bwrap = bwrap_path()
    if bwrap is None:
        return Confinement(False, None, False, "bubblewrap (bwrap) is not installed")
    filter_fd = _filter_fd()
    fds = [filter_fd] if filter_fd is not None else []
    try:
        args = _bwrap_args(bwrap, False, filter_fd) + [
            "--", _interpreter(False), "-I", "-S", "-c", _CONFINED_PROBE]
        out = subprocess.run(args, pass_fds=tuple(fds), timeout=30, env=_child_env(CONFINED_SCRATCH),
                             capture_output=True, text=True, cwd="/")
    except (OSError, subprocess.SubprocessError) as exc:
        return Confinement(False, bwrap, False, f"bubblewrap could not start: {exc}")
    finally:
        for fd in fds:
            os.close(fd)
    try:
        uid, pids, host_paths, sockets, tmp_empty, usr_writable = (int(v) for v in out.stdout.split())
    except ValueError:
        error = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return Confinement(False, bwrap, False, f"bubblewrap cannot create the namespaces here ({error})")
    missing = [what for what, bad in (("an unprivileged uid (user namespace)", uid == 0),
                                      ("a PID namespace", pids > 2),
                                      ("a mount namespace with a minimal view", host_paths or usr_writable
                                       or not tmp_empty)) if bad]
    if missing:
        return Confinement(False, bwrap, False, f"bubblewrap ran without {', '.join(missing)}")
    seccomp = filter_fd is not None and sockets == 0
    why = "" if seccomp else "the seccomp filter did not apply (libseccomp.so.2 missing?)"
    return Confinement(True, bwrap, seccomp, why)


def network_namespaces() -> bool:
    """Whether a sandboxed call runs in a network namespace of its own here (bubblewrap's, or
    the child's own ``unshare`` without it)."""
    return confinement().ok or _probe()[0]


def landlock_abi() -> int:
    """The Landlock ABI version this kernel offers (0: none, or not on Linux)."""
    return _probe()[1]


def isolation() -> dict[str, bool]:
    """Which isolation layers apply to a sandboxed call on this machine (docs/tools.md)."""
    confined = confinement()
    return {
        "process": True,
        "resource_limits": True,
        "pid_namespace": confined.ok,
        "mount_namespace": confined.ok,
        "user_namespace": confined.ok,
        "network_namespace": network_namespaces(),
        "seccomp": confined.ok and confined.seccomp,
        "scratch_size_limit": confined.ok,
        "landlock": landlock_abi() > 0,
        "nproc_limit": os.getuid() != 0,  # the kernel exempts uid 0 from RLIMIT_NPROC, user namespace or not
        "audit_hook": True,
    }


#: The layers without which the python tool refuses to run (unless the recipe opts out): the
#: kernel boundary that does not depend on the code's cooperation.
REQUIRED_LAYERS = ("pid_namespace", "mount_namespace", "user_namespace", "network_namespace", "seccomp")


def missing_layers() -> list[str]:
    """The `REQUIRED_LAYERS` this machine does not give a call (empty: fully confined)."""
    layers = isolation()
    return [name for name in REQUIRED_LAYERS if not layers[name]]


def refusal(opt_out_key: str) -> str | None:
    """The one-line reason the python tool must not run here, naming the first missing layer,
    why, what to install and the recipe key ``opt_out_key`` that runs it anyway; None when every
    required layer applies."""
    missing = missing_layers()
    if not missing:
        return None
    why = confinement().why
    return (f"the python tool's sandbox has no {missing[0].replace('_', ' ')} here ({why}; missing: "
            f"{', '.join(missing)}): {INSTALL_HINT}; or set {opt_out_key}: true to run tool code without "
            f"these layers (the audit hook, rlimits and Landlock where present only)")
