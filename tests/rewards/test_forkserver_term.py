"""A SIGTERM to every process of a run (SLURM's scancel) leaves its reward workers alive: the
pool's forkserver ignores SIGTERM, so the workers (which die with it) finish the step's rewards."""

import subprocess
import sys
import textwrap

from tests.subprocess_env import worker_env

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from multiprocessing import forkserver
    from rltt.data.reward_pool import RewardPool, Task

    with open("fns.py", "w") as f:
        f.write("def length(completion, answer, **kw):\\n    return float(len(completion))\\n")
    pool = RewardPool([("fns.py:length", os.getcwd())], workers=2)
    tasks = [Task(0, "ab" * i, None, {}, 30.0) for i in range(4)]
    assert pool.run(tasks) == [(float(2 * i), None) for i in range(4)]
    server = forkserver._forkserver._forkserver_pid
    workers = [w.process.pid for w in pool._workers]
    os.kill(server, signal.SIGTERM)
    time.sleep(0.5)
    os.kill(server, 0)  # still there
    assert pool.run(tasks) == [(float(2 * i), None) for i in range(4)]
    assert [w.process.pid for w in pool._workers] == workers and pool.restarts == 0
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # this process is not changed
    pool.close()
    print("ok")
""")


def test_the_forkserver_ignores_sigterm_and_the_workers_go_on(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=worker_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_the_preload_changes_nothing_outside_the_forkserver(tmp_path):
    code = ("import signal, rltt.data.forkserver_init as f; "
            "assert not f.in_forkserver() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=worker_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
