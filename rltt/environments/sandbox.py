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
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

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
    scratch, want_netns, want_landlock, hook_on = sys.argv[6], *(a == "1" for a in sys.argv[7:10])
    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout.reconfigure(line_buffering=True, errors="backslashreplace")
    sys.stderr.reconfigure(line_buffering=True, errors="backslashreplace")
    status = os.fdopen(status_fd, "w", encoding="utf-8")

    network = "none"
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if want_netns:
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
        if os.getppid() == 1:
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
        status.write(repr((kind, message, network, violations[:1], landlock)))
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


def _remove_tree(path: str) -> None:
    def fix(func, p, _exc):  # code may have made its files read-only
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=fix)
    else:
        shutil.rmtree(path, onerror=fix)


def run_python(source: str, *, timeout_s: float = 5.0, cpu_s: float = 5.0, memory_mb: int = 512,
               output_chars: int = 1024, site_packages: bool = False, _audit_hook: bool = True) -> SandboxRun:
    """Run ``source`` as a script in a fresh sandboxed interpreter (see the module docstring).

    The output is stdout and stderr interleaved, at most ``output_chars`` characters (head and
    tail around a marker when longer). If the last statement is an expression whose value is
    not None, its ``repr`` is printed, as in a notebook cell. ``site_packages=True`` lets the code
    import the environment's installed packages (read-only), not just the standard library.
    ``_audit_hook=False`` (tests only) leaves out the audit-hook guard to check the kernel layers.
    """
    start = time.monotonic()
    if len(source) > MAX_SOURCE_CHARS:
        kind, message = "too_long", f"the code has {len(source)} characters; the limit is {MAX_SOURCE_CHARS}"
        return SandboxRun(_finish(None, "", kind, message, output_chars), kind, time.monotonic() - start)
    scratch = tempfile.mkdtemp(prefix="rltt-tool-")
    try:
        return _run_in(scratch, source, start, timeout_s, cpu_s, memory_mb, output_chars, site_packages, _audit_hook)
    finally:
        _remove_tree(scratch)


def _run_in(scratch, source, start, timeout_s, cpu_s, memory_mb, output_chars, site_packages, audit_hook):
    status_r, status_w = os.pipe()
    cpu_limit = max(1, math.ceil(cpu_s))
    flags = ["-I", "-B", "-X", "utf8"] + ([] if site_packages else ["-S"])
    args = [sys.executable, *flags, "-c", _CHILD, str(status_w), str(cpu_limit), str(int(memory_mb)),
            str(FILE_SIZE_MB), str(OPEN_FILES), scratch, "1" if network_namespaces() else "0",
            "1" if landlock_abi() else "0", "1" if audit_hook else "0"]
    try:
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                pass_fds=(status_w,), cwd=scratch, env=_child_env(scratch),
                                start_new_session=True)
    except OSError as exc:
        os.close(status_r)
        os.close(status_w)
        kind, message = "sandbox", f"could not start the interpreter: {exc}"
        return SandboxRun(_finish(None, "", kind, message, output_chars), kind, time.monotonic() - start)
    os.close(status_w)
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
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the leader is not reaped yet: its group id is still ours
        except (ProcessLookupError, PermissionError):
            pass
        _, wait_status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        proc.stdout.close()
        os.close(status_r)
    capture.feed(b"", final=True)
    status = _parse_status(bytes(status_bytes))
    kind, message = _classify(proc.returncode, status, timed_out, usage.ru_utime + usage.ru_stime,
                              (timeout_s, cpu_s, memory_mb))
    output = _finish(capture, "", kind, message, output_chars)
    network, landlock = (status[2], status[4]) if status is not None else ("unknown", 0)
    return SandboxRun(output, kind, time.monotonic() - start, proc.returncode, network, landlock)


def _parse_status(data: bytes) -> tuple | None:
    try:
        value = ast.literal_eval(data.decode("utf-8", "replace"))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if (isinstance(value, tuple) and len(value) == 5 and all(isinstance(v, str) for v in value[:3])
            and isinstance(value[3], list) and isinstance(value[4], int)):
        return value
    return None


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


def network_namespaces() -> bool:
    """Whether a sandboxed call can run in a new user and network namespace here."""
    return _probe()[0]


def landlock_abi() -> int:
    """The Landlock ABI version this kernel offers (0: none, or not on Linux)."""
    return _probe()[1]


def isolation() -> dict[str, bool]:
    """Which isolation layers apply to a sandboxed call on this machine (docs/tools.md)."""
    return {
        "process": True,
        "resource_limits": True,
        "network_namespace": network_namespaces(),
        "landlock": landlock_abi() > 0,
        "nproc_limit": os.getuid() != 0,  # the kernel exempts uid 0 from RLIMIT_NPROC, user namespace or not
        "audit_hook": True,
    }
