"""The python tool's sandbox: every way tool code can misbehave ends as a counted error in its
own result, and the next call runs normally."""

import os
import time

import pytest

from rltt.environments.sandbox import (
    CONFINED_SCRATCH, ERRORS, SandboxRun, isolation, landlock_abi, network_namespaces, run_python, truncate,
)


def ok_after():
    """The parent is unaffected: a plain call right after works."""
    run = run_python("print(6 * 7)")
    assert (run.error, run.output) == (None, "42\n")


def test_plain_code_prints_and_shows_the_last_expression():
    run = run_python("x = 2 ** 100\nprint('x has', len(str(x)), 'digits')\nx % 1000")
    assert run.error is None
    assert run.output == f"x has 31 digits\n{2 ** 100 % 1000}\n"
    assert run.exit_code == 0 and run.seconds > 0


def test_stdout_and_stderr_interleave_in_order():
    run = run_python("import sys\nprint('a')\nsys.stderr.write('b\\n')\nprint('c')")
    assert run.output == "a\nb\nc\n"


def test_a_loop_forever_times_out_on_the_wall_clock():
    start = time.monotonic()
    run = run_python("while True:\n    pass", timeout_s=1.0, cpu_s=30)
    assert run.error == "timeout"
    assert time.monotonic() - start < 5
    assert run.output.endswith("[timeout: timed out after 1 s (the process was killed)]")
    ok_after()


def test_the_cpu_limit_kills_a_busy_loop():
    run = run_python("while True:\n    pass", timeout_s=30, cpu_s=1)
    assert run.error == "cpu", run
    assert "CPU-time limit of 1 s" in run.output


@pytest.mark.parametrize("code", [
    "x = bytearray(10 ** 10)",
    "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))",
])
def test_unbounded_allocation_is_a_memory_error(code):
    run = run_python(code, memory_mb=128, timeout_s=20)
    assert run.error == "memory", run
    assert "MemoryError" in run.output and "128 MB" in run.output
    ok_after()


@pytest.mark.parametrize("code", [
    "open({target!r}, 'w').write('x')",
    "import os\nos.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))",
    "import pathlib\npathlib.Path({target!r}).write_text('x')",
    "import shutil\nopen('here.txt', 'w').write('x')\nshutil.copy('here.txt', {target!r})",
    "import os\nopen('here.txt', 'w').write('x')\nos.rename('here.txt', {target!r})",
    "import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('x')",
])
def test_writes_outside_the_scratch_folder_are_refused(tmp_path, code):
    target = str(tmp_path / "written.txt")
    run = run_python(code.format(target=target))
    assert run.error == "forbidden", run
    assert "outside the tool's folder" in run.output
    assert not os.path.exists(target)


def test_removing_or_renaming_an_outside_file_is_refused(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    for code in (f"import os\nos.remove({str(victim)!r})", f"import os\nos.rename({str(victim)!r}, 'mine')",
                 f"import shutil\nshutil.rmtree({str(tmp_path)!r})", f"import os\nos.truncate({str(victim)!r}, 0)"):
        run = run_python(code)
        assert run.error == "forbidden", (code, run)
    assert victim.read_text() == "precious"


def test_a_refusal_counts_even_when_the_code_catches_it(tmp_path):
    target = str(tmp_path / "x")
    run = run_python(f"try:\n    open({target!r}, 'w')\nexcept PermissionError:\n    print('carried on')")
    assert run.error == "forbidden"
    assert run.output.startswith("carried on\n")


def test_reading_outside_the_library_and_scratch_is_refused(tmp_path):
    secret = tmp_path / "answers.jsonl"
    secret.write_text('{"answer": 42}')
    run = run_python(f"print(open({str(secret)!r}).read())")
    assert run.error == "forbidden" and "42" not in run.output
    run = run_python("import json, fractions, decimal, statistics, itertools\nprint(json.dumps([1]))")
    assert (run.error, run.output) == (None, "[1]\n")  # the standard library still imports


def test_the_scratch_folder_is_fresh_and_removed(tmp_path):
    code = "import os\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\nn = open('a.txt', 'w').write('x' * 10)"
    first, second = run_python(code), run_python(code)
    assert first.error is None and second.error is None
    cwd1, listing1 = first.output.splitlines()
    cwd2, listing2 = second.output.splitlines()
    assert listing1 == listing2 == "[]"
    if first.confined:  # a tmpfs of the call's own mount namespace, gone with it: nothing on the host
        assert cwd1 == cwd2 == CONFINED_SCRATCH and not os.path.exists(CONFINED_SCRATCH)
    else:
        assert cwd1 != cwd2
        assert not os.path.exists(cwd1) and not os.path.exists(cwd2)


def test_the_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("RLTT_TEST_SECRET_TOKEN", "hunter2")
    run = run_python("import os\nprint(os.environ.get('RLTT_TEST_SECRET_TOKEN'), sorted(os.environ))")
    assert run.error is None
    assert "hunter2" not in run.output and run.output.startswith("None ")


@pytest.mark.parametrize("code", [
    "import socket\nsocket.socket()",
    "import socket\nsocket.create_connection(('127.0.0.1', 9))",
    "import urllib.request\nurllib.request.urlopen('http://example.com')",
])
def test_sockets_are_refused(code):
    run = run_python(code)
    assert run.error == "forbidden", run
    assert "network access" in run.output


@pytest.mark.skipif(not network_namespaces(), reason="this kernel refuses unprivileged network namespaces")
def test_without_the_audit_hook_the_network_namespace_still_has_no_route():
    # UDP: Landlock (when present) governs TCP only, so this reaches the namespace's routing
    code = ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "try:\n    s.sendto(b'x', ('1.1.1.1', 53))\n    print('sent')\nexcept OSError as e:\n    print(e.errno)")
    run = run_python(code, _audit_hook=False, _seccomp=False)  # (the filter would refuse the socket itself)
    assert run.network == "namespace"
    assert run.error is None and run.output.strip() in {"101", "113"}  # ENETUNREACH / EHOSTUNREACH


@pytest.mark.parametrize("code, kind, shown", [
    ("import faulthandler\nfaulthandler._sigsegv()", "crash", "killed by SIGSEGV"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGABRT)", "crash", "killed by SIGABRT"),
    ("import os\nos._exit(3)", "exit", "exit status 3"),
    ("import sys\nsys.exit('bye')", "exit", "exit status 1"),
    ("def f():\n    raise ValueError('no parse')\nf()", "exception", "ValueError: no parse"),
    ("def f(:\n    pass", "syntax", "SyntaxError"),
    ("import ctypes\nctypes.string_at(0)", "forbidden", "importing ctypes"),
    ("import os\nos.kill(os.getppid(), 9)", "forbidden", "signalling process"),
    ("import subprocess\nsubprocess.run(['true'])", "forbidden", "starting a process"),
    ("import os\nos.fork()", "forbidden", "starting a process"),
    ("import multiprocessing.util as u\nu.spawnv_passfds(b'/bin/true', [b'/bin/true'], [])", "forbidden",
     "starting a process"),  # subprocess's C helper raises no audit event of its own
    ("import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 0)", "forbidden", "signalling process"),
    ("import sys, os\nfd = os.open(sys.path[1], os.O_RDONLY)\nos.open('x.py', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
     "forbidden", "opening the folder"),
    ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "forbidden", "changing resource limits"),
])
def test_crashes_and_refusals_are_counted_errors(code, kind, shown):
    run = run_python(code)
    assert run.error == kind, run
    assert shown in run.output
    assert kind in ERRORS
    ok_after()


def test_a_traceback_shows_the_code_not_the_sandbox():
    run = run_python("values = [1, 2]\nprint(values[5])")
    assert run.error == "exception"
    assert 'File "<tool>", line 2' in run.output and "print(values[5])" in run.output
    assert "<string>" not in run.output and "IndexError" in run.output


def test_sys_exit_zero_is_success():
    assert run_python("print('done')\nimport sys\nsys.exit(0)").error is None


def test_a_segfault_through_ctypes_is_a_crash_when_ctypes_is_let_through():
    run = run_python("import ctypes\nctypes.string_at(0)", _audit_hook=False)
    assert (run.error, run.exit_code) == ("crash", -11)
    ok_after()


@pytest.mark.skipif(os.getuid() != 0 and not network_namespaces(), reason="RLIMIT_NPROC stops the fork")
def test_the_timeout_kills_the_whole_process_group():
    code = ("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\n    os._exit(0)\n"
            "print(pid, flush=True)\ntime.sleep(60)")
    # without bubblewrap (whose seccomp filter refuses the fork; its PID namespace: test_sandbox_escapes.py)
    run = run_python(code, timeout_s=1.5, _audit_hook=False, _namespaces=False)
    if run.error == "exception" and "Resource temporarily unavailable" in run.output:
        pytest.skip("RLIMIT_NPROC stopped the fork")
    assert run.error == "timeout", run
    grandchild = int(run.output.split()[0])
    time.sleep(0.2)
    try:
        with open(f"/proc/{grandchild}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in {"gone", "Z", "X"}  # a zombie waiting for init is dead


def test_output_is_truncated_to_the_budget_with_a_marker():
    run = run_python("for i in range(2000):\n    print(f'line {i}')", output_chars=300)
    assert run.error is None
    assert len(run.output) <= 300
    assert run.output.startswith("line 0\nline 1\n") and run.output.endswith("line 1999\n")
    assert "output truncated:" in run.output
    endless = run_python("while True:\n    print('spam' * 100)", timeout_s=1, output_chars=200)
    assert endless.error == "timeout" and len(endless.output) <= 200
    assert endless.output.endswith("[timeout: timed out after 1 s (the process was killed)]")


def test_truncate_keeps_head_and_tail_and_counts_the_cut():
    text = "".join(f"{i:05d}" for i in range(1000))  # 5000 characters
    for budget in (80, 100, 333, 4999):
        out = truncate(text, budget)
        assert len(out) <= budget
        head, rest = out.split("\n[... output truncated: ", 1)
        cut = int(rest.split(" ", 1)[0])
        tail = rest.split("characters cut ...]\n", 1)[1]
        assert text.startswith(head) and text.endswith(tail)
        assert len(head) + len(tail) + cut == len(text)
    assert truncate(text, 5000) == text


def test_unicode_output_survives_and_a_long_source_is_refused():
    assert run_python("print('π ≈ 3.14159 — ok')").output == "π ≈ 3.14159 — ok\n"
    run = run_python("x = 1\n" * 5000)
    assert run.error == "too_long" and isinstance(run, SandboxRun)


def test_isolation_reports_the_layers():
    layers = isolation()
    assert layers["process"] and layers["resource_limits"] and layers["audit_hook"]
    assert layers["network_namespace"] == network_namespaces()


@pytest.mark.skipif(landlock_abi() < 1, reason="this kernel has no Landlock")
@pytest.mark.parametrize("code, needs_abi", [
    ("open({outside!r}, 'w').write('x')", 1),
    ("print(open({secret!r}).read())", 1),
    ("import os\nos.execv('/bin/true', ['true'])", 1),
    ("import socket\nsocket.socket().connect(('127.0.0.1', 9))", 4),
    ("import os\nos.kill(os.getppid(), 0)", 6),
])
def test_without_the_audit_hook_the_kernel_still_refuses(tmp_path, code, needs_abi):
    if landlock_abi() < needs_abi:
        pytest.skip(f"needs Landlock ABI {needs_abi}")
    outside, secret = tmp_path / "written.txt", tmp_path / "secret.txt"
    secret.write_text("the answer is 42")
    # Landlock alone: bubblewrap's mount namespace would hide these paths altogether
    run = run_python(code.format(outside=str(outside), secret=str(secret)), _audit_hook=False, _namespaces=False)
    assert run.landlock == landlock_abi()
    assert run.error == "exception" and "PermissionError" in run.output, run
    assert not outside.exists() and "42" not in run.output


@pytest.mark.skipif(landlock_abi() < 1, reason="this kernel has no Landlock")
def test_without_the_audit_hook_the_scratch_folder_and_the_library_still_work():
    code = ("import json, zlib, decimal, os\nopen('a.txt', 'w').write(json.dumps([zlib.crc32(b'a')]))\n"
            "os.mkdir('d')\nos.rename('a.txt', 'd/b.txt')\nprint(open('d/b.txt').read())")
    for namespaces in (True, False):
        run = run_python(code, _audit_hook=False, _namespaces=namespaces)
        assert (run.error, run.output) == (None, "[3904355907]\n")


def test_installed_packages_import_only_when_asked():
    code = "import yaml\nprint(yaml.safe_dump({'a': 1}).strip())"
    assert run_python(code).error == "exception"  # the standard library alone
    run = run_python(code, site_packages=True)
    assert (run.error, run.output) == (None, "a: 1\n")


def test_concurrent_calls_keep_their_own_outputs_and_folders():
    from concurrent.futures import ThreadPoolExecutor

    code = "import os\nopen('mine.txt', 'w').write('{i}')\nprint({i}, sorted(os.listdir('.')), open('mine.txt').read())"
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda i: run_python(code.format(i=i)), range(8)))
    assert [r.output for r in runs] == [f"{i} ['mine.txt'] {i}\n" for i in range(8)]


def test_a_file_beyond_the_size_limit_fails_the_write_not_the_disk():
    from rltt.environments.sandbox import FILE_SIZE_MB

    run = run_python(f"f = open('big.bin', 'wb')\nf.write(b'x' * ({FILE_SIZE_MB} << 20))\nf.write(b'x')\nf.flush()")
    assert run.error == "exception" and "File too large" in run.output, run


@pytest.mark.parametrize("exit_code, status, timed_out, cpu_used, kind", [
    (-9, None, False, 2.1, "cpu"),        # SIGXCPU ignored: the hard limit's SIGKILL
    (-24, None, False, 1.0, "cpu"),       # SIGXCPU at the soft limit
    (-9, None, False, 0.1, "crash"),      # a SIGKILL from elsewhere (the OOM killer)
    (-9, None, True, 0.1, "timeout"),     # our own kill at the wall-clock limit
    (0, None, False, 0.1, "sandbox"),     # ended without a report
    (3, None, False, 0.1, "exit"),        # os._exit(3)
    (0, ("ok", "", "namespace", [], 7), False, 0.1, None),
    (0, ("ok", "", "namespace", ["writing '/x'"], 7), False, 0.1, "forbidden"),
    (0, ("exception", "URLError", "namespace", ["network access"], 7), False, 0.1, "forbidden"),
    (0, ("memory", "MemoryError", "namespace", [], 7), False, 0.1, "memory"),
])
def test_outcomes_are_classified(exit_code, status, timed_out, cpu_used, kind):
    from rltt.environments.sandbox import _classify

    assert _classify(exit_code, status, timed_out, cpu_used, (5.0, 1.0, 512))[0] == kind


def test_what_the_guard_refuses_elsewhere_still_works_inside():
    code = ("import asyncio, subprocess, os\nos.mkdir('d')\nfd = os.open('d', os.O_RDONLY)\n"
            "os.close(os.open('f', os.O_WRONLY | os.O_CREAT, dir_fd=fd))\nprint(os.listdir('d'))")
    assert run_python(code).output == "['f']\n"
