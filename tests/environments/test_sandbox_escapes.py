"""What tool code must not get past, tried as hostile code would (docs/tools.md, "Kernel layers").

Most probes run with the audit hook switched off (``_audit_hook=False``): pure Python can disable
it, so what holds must be the kernel's layers. Where a probe can be stopped by two layers, it runs
with each alone too (``_seccomp=False``: the namespaces by themselves).
"""

import os
import socket
import sys
import tempfile
import time

import pytest

from rltt.config import from_dict
from rltt.environments import sandbox, syscall_filter
from rltt.environments.env_section import EnvSection
from rltt.environments.sandbox import SANDBOX_UID, SCRATCH_MB, Confinement, run_python
from rltt.environments.tool_env import ToolEnvironment
from rltt.environments.tools import run_tool
from rltt.errors import RlttError

CONFINED = sandbox.confinement()
needs_bwrap = pytest.mark.skipif(not CONFINED.ok, reason=f"no kernel confinement on this host: {CONFINED.why} "
                                                          f"({sandbox.INSTALL_HINT})")
needs_seccomp = pytest.mark.skipif(not (CONFINED.ok and CONFINED.seccomp),
                                   reason=f"the seccomp filter does not apply here: {CONFINED.why}")


def _processes_named(marker: str) -> list[int]:
    """Live processes named ``marker`` (a zombie waiting for its reaper is dead)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                name, _, rest = f.read().partition("(")[2].rpartition(")")
            if name == marker and rest.split()[0] not in ("Z", "X"):
                found.append(int(pid))
        except OSError:
            pass
    return found


def _survivors(marker: str, within_s: float = 3.0) -> list[int]:
    """The processes named ``marker`` still alive ``within_s`` seconds from now (the kernel kills a
    PID namespace's processes as its init dies; on a loaded machine that takes a moment)."""
    end = time.monotonic() + within_s
    while (found := _processes_named(marker)) and time.monotonic() < end:
        time.sleep(0.05)
    return found


@needs_bwrap
@pytest.mark.parametrize("seccomp", [True, False], ids=["all-layers", "pid-namespace-alone"])
def test_a_detached_fork_does_not_outlive_its_call(seccomp):
    marker = f"rlttesc{os.getpid() % 100000}{int(seccomp)}"
    code = ("import os, time, ctypes\n"
            "try:\n    pid = os.fork()\nexcept OSError as e:\n    print('fork refused', e.errno)\n    raise SystemExit\n"
            "if pid == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        ctypes.CDLL(None).prctl(15, {marker.encode()!r}, 0, 0, 0)\n        time.sleep(30)\n"
            "    os._exit(0)\n"
            "time.sleep(0.3)\nprint('forked')")
    run = run_python(code, _audit_hook=False, _seccomp=seccomp)
    assert run.confined and run.error is None, run
    assert run.output.startswith("fork refused 1" if seccomp else "forked"), run.output  # EPERM: the filter
    survivors = _survivors(marker)
    for pid in survivors:  # do not leave them behind whatever the outcome
        os.kill(pid, 9)
    assert survivors == []


@needs_bwrap
@pytest.mark.parametrize("seccomp", [True, False], ids=["all-layers", "mount-namespace-alone"])
def test_a_unix_socket_outside_is_unreachable(seccomp):
    with tempfile.TemporaryDirectory(prefix="rltt-sock-") as folder:
        path = os.path.join(folder, "s")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(1)
        listener.setblocking(False)
        code = (f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\n"
                "s.sendall(b'hello')\nprint('connected')")
        run = run_python(code, _audit_hook=False, _seccomp=seccomp)
        with pytest.raises(BlockingIOError):
            listener.accept()
        listener.close()
    assert "connected" not in run.output and run.error == "exception", run
    assert ("PermissionError" if seccomp else "FileNotFoundError") in run.output


@pytest.mark.parametrize("namespaces", [True, False], ids=["confined", "unconfined"])
def test_deep_folders_neither_raise_nor_leave_a_scratch(namespaces):
    if namespaces and not CONFINED.ok:
        pytest.skip(f"no kernel confinement on this host: {CONFINED.why}")
    code = "import os\nfor _ in range(1200):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')"
    mine = f"{sandbox._SCRATCH_PREFIX}{os.getpid()}-"
    before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(mine)}
    run = run_python(code, _namespaces=namespaces, timeout_s=20)
    assert run.output == "deep\n" and run.error is None, run
    assert run.confined == namespaces
    left = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(mine)} - before
    assert left == set()


def test_remove_tree_takes_a_deep_read_only_tree_without_recursing(tmp_path):
    top = tmp_path / "scratch"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for i in range(1500):  # deeper than the recursion limit and than PATH_MAX as one path ('dd/' * 1500)
        os.mkdir("dd", dir_fd=fd)
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as f:
            f.write("x")
        inner = os.open("dd", os.O_RDONLY, dir_fd=fd)
        if i % 500 == 0:
            os.chmod(fd, 0o500)
        os.close(fd)
        fd = inner
    os.close(fd)
    sandbox._remove_tree(str(top))
    assert not top.exists()


@pytest.mark.parametrize("namespaces", [True, False], ids=["confined", "unconfined"])
def test_a_forged_status_record_is_a_tool_error(namespaces):
    if namespaces and not CONFINED.ok:
        pytest.skip(f"no kernel confinement on this host: {CONFINED.why}")
    code = "import os\nfor fd in range(3, 256):\n    try:\n        os.write(fd, b'{[]: 1}')\n    except OSError:\n" \
           "        pass\nos._exit(0)"
    run = run_python(code, _namespaces=namespaces)
    assert run.error == "sandbox" and "status record" in run.output, run
    if namespaces:
        result = run_tool("python", code)
        assert result.error == "sandbox"


@pytest.mark.parametrize("record", [b"{[]: 1}", b"(" * 5000, b"('ok', '', 'x', [1], 7, 0)", b"\xff\xfe",
                                    b"('ok', '', 'x', [], True, 0)"])
def test_an_unreadable_status_record_parses_to_none(record):
    assert sandbox._parse_status(record) is None


def _no_boundary(monkeypatch):
    monkeypatch.setattr(sandbox, "confinement",
                        lambda: Confinement(False, None, False, "bubblewrap (bwrap) is not installed"))


def test_without_a_kernel_boundary_the_python_tool_is_refused_in_one_line(monkeypatch):
    _no_boundary(monkeypatch)
    section = from_dict(EnvSection, {"name": "tools", "tools": ["python", "calculator"]})
    with pytest.raises(RlttError) as refused:
        ToolEnvironment.from_section(section)
    message = str(refused.value)
    assert "\n" not in message
    assert "pid namespace" in message and "env.python.unconfined: true" in message
    assert "apt-get install bubblewrap" in message and "bubblewrap (bwrap) is not installed" in message
    # the calculator alone needs no sandbox
    assert ToolEnvironment.from_section(from_dict(EnvSection, {"name": "tools", "tools": ["calculator"]})).isolation is None


def test_the_opt_out_runs_unconfined_and_says_so(monkeypatch):
    _no_boundary(monkeypatch)
    section = from_dict(EnvSection, {"name": "tools", "tools": ["python"], "python": {"unconfined": True}})
    env = ToolEnvironment.from_section(section)
    assert env.isolation["unconfined_opt_out"] and not env.isolation["pid_namespace"]
    assert not env.isolation["seccomp"] and env.isolation["audit_hook"]
    run = run_python("print(1)")
    assert (run.output, run.confined) == ("1\n", False)


def test_the_opt_out_key_is_validated():
    with pytest.raises(RlttError, match="env.python.unconfined"):
        from_dict(EnvSection, {"name": "tools", "python": {"unconfined": "sometimes"}}, "env")


def test_the_review_shows_the_layers(tmp_path):
    import json

    from rltt.telemetry.run_review import isolation_line

    assert isolation_line(tmp_path) is None
    (tmp_path / "isolation.json").write_text(json.dumps({"pid_namespace": True, "seccomp": False,
                                                         "unconfined_opt_out": False}))
    assert isolation_line(tmp_path) == "python tool isolation: pid_namespace; missing: seccomp"


# -- each kernel layer, where the host allows it ---------------------------------------------

_LAYER_PROBES = {
    "unprivileged uid": ("import os\nprint(os.getuid(), os.getgid())", f"{SANDBOX_UID} {SANDBOX_UID}\n"),
    "pid namespace": ("import os\nprint(os.getpid(), os.getppid())", "2 1\n"),  # bubblewrap's init is 1
    "minimal view": ("import os\nprint([p for p in ('/run', '/home', '/etc/passwd', '/var', '/work', '/bin/sh', '/tmp/x') "
                     "if os.path.exists(p)], os.stat('/tmp').st_nlink, os.listdir('.'))", "[] 2 []\n"),
    "read-only libraries": ("try:\n    open('/usr/lib/rltt-probe', 'w')\nexcept OSError as e:\n    print(e.errno)",
                            {"30\n", "13\n"}),  # EROFS (the mount), EACCES (Landlock)
    "own host name (UTS namespace)": ("import os\nprint(os.uname().nodename)", "sandbox\n"),
}
_SECCOMP_PROBES = {
    "socket": "import socket\nsocket.socket(socket.AF_UNIX)",
    "socketpair": "import socket\nsocket.socketpair()",
    "ptrace": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nassert libc.ptrace(0, 0, 0, 0) == -1\n"
              "raise OSError(ctypes.get_errno(), 'ptrace')",
    "mount": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nimport os\nos.mkdir('m')\n"
             "assert libc.mount(b'none', b'm', b'tmpfs', 0, None) == -1\nraise OSError(ctypes.get_errno(), 'mount')",
    "unshare": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nassert libc.unshare(0x10000000) == -1\n"
               "raise OSError(ctypes.get_errno(), 'unshare')",
    "keyctl": "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
              "assert libc.syscall(250, 0, -3, 0) == -1\nraise OSError(ctypes.get_errno(), 'keyctl')",  # x86-64 number
}


@needs_bwrap
@pytest.mark.parametrize("layer", list(_LAYER_PROBES))
def test_each_namespace_layer_is_present(layer):
    code, expected = _LAYER_PROBES[layer]
    run = run_python(code, _audit_hook=False)
    assert run.confined and run.error is None, run
    assert run.output in (expected if isinstance(expected, set) else {expected}), run.output


@needs_seccomp
@pytest.mark.parametrize("call", list(_SECCOMP_PROBES))
def test_the_seccomp_filter_refuses(call):
    if call == "keyctl" and os.uname().machine != "x86_64":
        pytest.skip("the probe uses the x86-64 syscall number")
    run = run_python(_SECCOMP_PROBES[call], _audit_hook=False)
    assert run.error == "exception" and ("PermissionError" in run.output or "[Errno 1]" in run.output), run.output
    # and without the filter the same call gets further (the refusal is the filter's)
    if call in ("socket", "socketpair"):
        assert run_python(_SECCOMP_PROBES[call], _audit_hook=False, _seccomp=False).error is None


def test_the_filter_program_is_whole_bpf_instructions():
    program = syscall_filter.program()
    if program is None:
        pytest.skip("libseccomp is not installed")
    assert len(program) % 8 == 0 and len(program) > 8 * 20  # struct sock_filter: 8 bytes each


@needs_bwrap
def test_the_scratch_is_bounded_and_counted():
    code = (f"chunk = b'x' * (8 << 20)\nn = 0\ntry:\n    for i in range({SCRATCH_MB // 8 + 4}):\n"
            "        with open(f'f{i}', 'wb') as f:\n            f.write(chunk)\n        n += 1\n"
            "except OSError as e:\n    print(e.errno, n)")
    run = run_python(code, timeout_s=20)
    assert run.error is None and run.output.split()[0] == "28", run  # ENOSPC
    assert SCRATCH_MB << 20 >= run.disk_bytes >= (SCRATCH_MB - 8) << 20
    assert run_python("print(1)").disk_bytes < 1 << 20  # the next call's scratch is empty again


@needs_bwrap
def test_a_confined_crash_and_cpu_limit_keep_their_kinds():
    assert run_python("import faulthandler\nfaulthandler._sigsegv()").error == "crash"
    assert run_python("while True:\n    pass", cpu_s=1, timeout_s=10).error == "cpu"
    assert sys.executable  # (the interpreter the calls ran is this one's real file)


@needs_bwrap
@pytest.mark.parametrize("seccomp", [True, False], ids=["all-layers", "namespaces-alone"])
def test_the_callers_files_secrets_and_process_are_out_of_reach(tmp_path, monkeypatch, seccomp):
    monkeypatch.setenv("RLTT_TEST_SECRET_TOKEN", "hunter2")
    secret, outside = tmp_path / "secret.txt", tmp_path / "written.txt"
    secret.write_text("the answer is 42")
    probes = [f"open({str(outside)!r}, 'w').write('x')", f"print(open({str(secret)!r}).read())",
              f"print(open('/proc/{os.getpid()}/environ').read())", f"os.kill({os.getpid()}, 0)",
              "print(os.environ.get('RLTT_TEST_SECRET_TOKEN'))"]  # (this process's pid: not in the namespace)
    code = "import os\n" + "".join(f"try:\n    {p}\n    print('reached {i}')\nexcept OSError as e:\n"
                                    f"    print('refused {i}', type(e).__name__)\n" for i, p in enumerate(probes))
    run = run_python(code, _audit_hook=False, _seccomp=seccomp)
    assert run.confined and run.error is None, run
    assert not outside.exists() and "42" not in run.output and "hunter2" not in run.output
    lines = run.output.splitlines()
    assert [line.split()[0] for line in lines[:4]] == ["refused"] * 4, run.output
    assert lines[4] == "None"
