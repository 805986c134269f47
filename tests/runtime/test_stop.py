"""`rltt.runtime.stop` with real signals: the first asks to stop, a step past its grace is
abandoned unless it committed, a second signal exits at once, and the handlers are restored."""

import os
import signal
import subprocess
import sys
import time

import pytest

from rltt.runtime.stop import EXIT_STOPPED, StepAbandoned, StopSignals, commit

from ..subprocess_env import worker_env


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.005)


def test_the_first_signal_asks_to_stop_and_the_step_finishes_within_its_grace():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopSignals(5.0, "test") as stop:
        with stop.step():
            os.kill(os.getpid(), signal.SIGTERM)
            _busy(0.05)
            assert stop.requested and stop.signame == "SIGTERM" and not stop.expired
        _busy(0.05)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    assert EXIT_STOPPED == 75


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_step_past_its_grace_is_abandoned(signum):
    with StopSignals(0.2, "test") as stop:
        start = time.monotonic()
        with pytest.raises(StepAbandoned):
            with stop.step():
                os.kill(os.getpid(), signum)
                _busy(10)
        assert 0.15 < time.monotonic() - start < 5


def test_a_committed_step_finishes_past_its_grace_and_a_signal_before_a_step_abandons_it():
    with StopSignals(0.1, "test") as stop:
        with stop.step():
            commit()
            os.kill(os.getpid(), signal.SIGINT)
            _busy(0.4)  # past the grace: committed, so no StepAbandoned
        assert stop.expired is False and stop.requested
        with pytest.raises(StepAbandoned):  # a loop that started a step anyway: it runs its grace only
            with stop.step():
                _busy(10)


def test_without_abandon_the_step_always_finishes():
    with StopSignals(0.0, "test", abandon=False) as stop:
        with stop.step():
            os.kill(os.getpid(), signal.SIGTERM)
            _busy(0.2)
        assert stop.requested


def test_commit_outside_a_loop_is_a_no_op():
    commit()


SECOND = """
import os, signal, time
from rltt.runtime.stop import StopSignals
with StopSignals(60, "test") as stop:
    with stop.step():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
print("not reached")
"""


def test_a_second_signal_exits_at_once():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SECOND], env=worker_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM and "not reached" not in proc.stdout
    assert "second signal (SIGTERM): exiting now" in proc.stderr
    assert time.monotonic() - start < 20


class _OuterAlarm(Exception):
    pass


def _outer_alarm(signum, frame):
    raise _OuterAlarm


def test_a_callers_alarm_keeps_running_through_steps():
    """A time budget set around the whole loop (SIGALRM with ITIMER_REAL, as bench/gpu_check's
    sections do) still fires: the loop's steps do not cancel it when no stop was asked for."""
    previous = signal.signal(signal.SIGALRM, _outer_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        start = time.monotonic()
        with pytest.raises(_OuterAlarm):
            with StopSignals(5.0, "test") as stop:
                for _ in range(100):
                    with stop.step():
                        _busy(0.02)
        assert time.monotonic() - start < 1.5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_callers_alarm_is_given_back_after_the_grace_timer():
    """A stop signal arms the grace timer over the caller's alarm; the step's end gives the caller's
    handler and its remaining time back."""
    previous = signal.signal(signal.SIGALRM, _outer_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        start = time.monotonic()
        with StopSignals(5.0, "test") as stop:
            with stop.step():
                os.kill(os.getpid(), signal.SIGTERM)
                _busy(0.05)
                assert signal.getsignal(signal.SIGALRM) != _outer_alarm  # the grace timer holds it
            assert signal.getsignal(signal.SIGALRM) is _outer_alarm
            assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 1.0
            with pytest.raises(_OuterAlarm):
                _busy(3)
        assert 0.8 < time.monotonic() - start < 2.5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
