"""Preloaded by the reward pool's forkserver (`rltt.data.reward_pool`), and acting only there.

A scheduler that signals every process of a job (SLURM's ``scancel``, a signal to the process
group) would otherwise end the forkserver at the first SIGTERM, and with it — through their
parent-death signal — the reward workers of the step the run is finishing before it stops
(`rltt.runtime.stop`). The forkserver ignores SIGTERM instead; it still exits when the run's
process does (its connection to it closes), and the workers with it.
"""

import signal
import sys


def in_forkserver() -> bool:
    """Whether this process is multiprocessing's forkserver (started as ``python -c 'from
    multiprocessing.forkserver import main; main(...)'``)."""
    return sys.argv == ["-c"] and "multiprocessing.forkserver" in sys.modules


if in_forkserver():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
