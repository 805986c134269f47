"""The seccomp filter a sandboxed tool call runs under (docs/tools.md, "Kernel layers").

The filter is compiled by libseccomp (the system library ``libseccomp.so.2``, called through
`ctypes`) into a classic-BPF program that bubblewrap loads, with ``--seccomp FD``, just before it
starts the interpreter. libseccomp, not a hand-assembled program, because it gets the parts that
are easy to get wrong right: the architecture check (a syscall made through another ABI — 32-bit
``int 0x80`` or x32 on x86-64 — is killed, not let through under another number), the syscall
numbers of each architecture, and argument comparisons on 64-bit values.

Everything is allowed except `DENIED` (``EPERM``), process creation (``clone`` without
``CLONE_THREAD``, or with any new-namespace flag: ``EPERM``; ``fork``/``vfork``: ``EPERM``) and
``clone3`` (``ENOSYS``: its flags sit in memory a filter cannot read, and the C library then falls
back to ``clone``, which the filter can check). A deny-list, because the interpreter and the
standard library use a wide and version-dependent set of ordinary syscalls; what is denied is what
tool code never needs and what reaches past the other layers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from functools import lru_cache

#: Syscalls refused with EPERM, by what they would give the code.
DENIED = {
    "sockets of any family": ("socket", "socketpair", "socketcall"),
    "tracing other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
    "mounts": ("mount", "umount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsmount",
               "fsconfig", "fspick", "mount_setattr"),
    "new namespaces": ("unshare", "setns"),
    "kernel keyrings": ("keyctl", "add_key", "request_key"),
    "io_uring (it runs socket and file operations outside this filter)": (
        "io_uring_setup", "io_uring_enter", "io_uring_register"),
    "kernel interfaces tools never use": ("bpf", "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load",
                                          "init_module", "finit_module", "delete_module", "reboot", "swapon",
                                          "swapoff", "acct", "quotactl", "syslog", "chroot", "personality"),
    "new processes": ("fork", "vfork"),
}

_CLONE_THREAD = 0x00010000
_CLONE_NEW = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
              "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
              "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080}

_ACT_ALLOW = 0x7FFF0000
_CMP_MASKED_EQ = 7
_NR_ERROR = -1  # __NR_SCMP_ERROR: a name this libseccomp does not know


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


@lru_cache(maxsize=None)
def _library():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def available() -> bool:
    """Whether libseccomp is installed and compiles the filter."""
    return program() is not None


@lru_cache(maxsize=None)
def program() -> bytes | None:
    """The filter as a classic-BPF program (``struct sock_filter[]``, what ``--seccomp`` reads),
    compiled once per process; None without libseccomp."""
    lib = _library()
    if lib is None:
        return None
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        return None
    try:
        def add(action: int, name: str, *cmps: tuple[int, int, int]) -> None:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number == _NR_ERROR:
                return  # not a syscall of this architecture
            array = (_ArgCmp * max(1, len(cmps)))(*[_ArgCmp(arg, _CMP_MASKED_EQ, mask, value)
                                                     for arg, mask, value in cmps])
            rc = lib.seccomp_rule_add_array(ctx, action, number, len(cmps), array)
            if rc != 0:
                raise OSError(-rc, f"seccomp_rule_add({name}): {os.strerror(-rc)}")

        eperm = _errno_action(errno.EPERM)
        for names in DENIED.values():
            for name in names:
                add(eperm, name)
        add(_errno_action(errno.ENOSYS), "clone3")
        add(eperm, "clone", (0, _CLONE_THREAD, 0))  # a new process (not a thread)
        for flag in _CLONE_NEW.values():
            add(eperm, "clone", (0, flag, flag))
        read_fd, write_fd = os.pipe()
        try:
            rc = lib.seccomp_export_bpf(ctx, write_fd)
            os.close(write_fd)
            write_fd = -1
            if rc != 0:
                return None
            chunks = []
            while chunk := os.read(read_fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
    except OSError:
        return None
    finally:
        lib.seccomp_release(ctx)
