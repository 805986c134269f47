"""Stopping a run on SIGTERM / SIGINT without losing its work.

A scheduler that preempts a job (SLURM's ``scancel``, a Kubernetes eviction) sends SIGTERM and,
after a grace period (30 s by default for both), SIGKILL; Ctrl-C at a desk sends SIGINT. Inside
`StopSignals` (the loop of ``rltt train``, ``pretrain``, ``convert`` and ``curate``):

- the **first** signal asks the loop to stop. The step in progress may finish within
  ``train.stop_grace_s`` seconds of the signal; past that, a step that has not *committed* yet
  (`commit`: from the point where it changes the state a checkpoint holds — the learner's
  update, the optimizer step, the journal append) is abandoned by raising `StepAbandoned` in the
  main thread. A committed step always finishes. At the next step boundary (or after the
  abandoned step) the loop writes a checkpoint of the last completed step, flushes its metrics
  and raises `Stopped`; the command exits with `EXIT_STOPPED` and ``--resume`` continues from
  that step exactly as the uninterrupted run would have.
- a **second** signal exits at once, as the signal's default action (the checkpoints on disk
  are complete or absent, as after a kill -9).

Without ``abandon`` (a data-parallel torchrun run: a rank that left a step would leave the
others waiting in a collective) the step in progress always finishes; the ranks agree on
stopping with one reduction of the flag at each step boundary, so all stop at the same step.

Signal handlers exist in the main thread only; elsewhere (a loop run from a worker thread)
`StopSignals` installs nothing and the signals keep their previous meaning.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

#: the exit status of a command stopped by SIGTERM / SIGINT after keeping its work (sysexits'
#: EX_TEMPFAIL: a temporary failure, to be retried — with ``--resume``)
EXIT_STOPPED = 75
#: the signals that stop a run
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StepAbandoned(BaseException):
    """Raised in the main thread when the grace ran out in a step that has not committed: the
    state a checkpoint holds is still the last completed step's. A `BaseException`, so that no
    ``except Exception`` inside the step (a reward function's guard) swallows it."""


class Stopped(Exception):
    """A run stopped by a signal after keeping its work: ``step`` is the last completed step and
    ``checkpoint`` its checkpoint (None: nothing to keep yet, or nothing a rerun does not redo)."""

    def __init__(self, command: str, signame: str, step: int, checkpoint: Path | None, resume: str,
                 progress: str | None = None):
        self.command, self.signame, self.step, self.checkpoint = command, signame, step, checkpoint
        if progress is None:
            where = f"checkpoint {checkpoint}" if checkpoint is not None else "nothing to checkpoint"
            progress = f"after step {step} ({where})"
        super().__init__(f"stopped by {signame} {progress}; {resume}")


def _say(text: str) -> None:
    """One line on stderr from a signal handler (os.write: never a reentrant buffered write)."""
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


_active: list["StopSignals"] = []


def active() -> "StopSignals | None":
    """The innermost `StopSignals` in force in this process, if any."""
    return _active[-1] if _active else None


def commit() -> None:
    """The step in progress is about to change the state a checkpoint holds: from here it
    finishes, even past the grace. A no-op outside `StopSignals` or a step."""
    stop = active()
    if stop is not None:
        stop.committed = True


class StopSignals:
    """SIGTERM / SIGINT handling for one loop (a context manager; see the module docstring).

    ``grace_s``: how long after the first signal a step that has not committed may still run;
    ``command``: names the command in the lines printed; ``abandon``: whether a step past its
    grace may be abandoned at all."""

    def __init__(self, grace_s: float, command: str, abandon: bool = True):
        self.grace_s, self.command, self.abandon = float(grace_s), command, abandon
        self.signame: str | None = None
        self.in_step = self.committed = False
        self.expired = False
        self._previous: dict[int, object] = {}
        # while the grace timer is armed: the SIGALRM handler and ITIMER_REAL it displaced (an alarm of
        # the caller's, e.g. a time budget around the whole run), and when; restored on disarming
        self._outer_alarm: tuple | None = None

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived."""
        return self.signame is not None

    # -- installing -------------------------------------------------------------------------
    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._disarm()
        if self._previous:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            self._previous = {}
        if self in _active:
            _active.remove(self)

    # -- steps ------------------------------------------------------------------------------
    @contextmanager
    def step(self) -> Iterator[None]:
        """One step of the loop: abandonable (past the grace) until `commit`."""
        self.in_step, self.committed = True, False
        try:
            if self.requested:  # asked to stop before the step began (the loop checks first)
                self._arm()
            yield
        finally:
            self.committed = True
            self.in_step = False
            self._disarm()

    # -- handlers ---------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:  # the second signal: exit at once, as the signal's default action
            _say(f"{self.command}: second signal ({name}): exiting now")
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signame = name
        what = "the step in progress may finish" if self.abandon else "the step in progress finishes"
        grace = f" (within train.stop_grace_s={self.grace_s:g} s)" if self.abandon else ""
        _say(f"{self.command}: {name}: stopping: {what}{grace}, then a checkpoint of the last completed step; "
             f"send it again to exit at once")
        if self.in_step:
            self._arm()

    def _arm(self) -> None:
        if not self.abandon or self.committed:
            return
        if self.grace_s <= 0:
            self._expire()
        elif self._previous:
            if self._outer_alarm is None:
                handler = signal.signal(signal.SIGALRM, self._on_alarm)
                self._outer_alarm = (handler, signal.getitimer(signal.ITIMER_REAL), time.monotonic())
            signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def _disarm(self) -> None:
        """Stop the grace timer, if armed, and give back the SIGALRM handler and the timer it displaced
        (less the time that passed), so a caller's own alarm still fires."""
        if self._outer_alarm is None:
            return
        handler, (remaining, interval), armed_at = self._outer_alarm
        self._outer_alarm = None
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if remaining > 0:
            signal.setitimer(signal.ITIMER_REAL, max(remaining - (time.monotonic() - armed_at), 1e-3), interval)

    def _on_alarm(self, signum, frame) -> None:
        self._expire()

    def _expire(self) -> None:
        self.expired = True
        if self.abandon and self.in_step and not self.committed:
            raise StepAbandoned(f"the step in progress did not finish within train.stop_grace_s={self.grace_s:g} s")


def help_text(resume: str = "--resume") -> str:
    """What a signal does, for a command's ``--help``."""
    return (f"SIGTERM / SIGINT (a scheduler's preemption, Ctrl-C): the step in progress may finish within "
            f"train.stop_grace_s (default 20 s; a step that has not reached its update by then is abandoned), "
            f"the last completed step is checkpointed, the metrics are flushed and the command exits with status "
            f"{EXIT_STOPPED}; {resume} continues from that step. A second signal exits at once. Exit status: 0 done, "
            f"2 error, {EXIT_STOPPED} stopped.")
