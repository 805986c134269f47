"""SIGTERM / SIGINT in `rltt curate`: the block in flight finishes within the grace (or is
abandoned), every finished block is kept, and rerunning the same command ends as the
uninterrupted run. Real signals, sent by the run to itself at an exact call."""

import os
import signal

import pytest

from rltt.runtime.stop import Stopped

from . import fakes
from .test_curate import CORRECT, RECORDS, curate, read_jsonl


class SignallingEngine(fakes.ScriptedEngine):
    """Sends ``signum`` to this process at the start of generate call ``at`` (1-based)."""

    def __init__(self, at: int, signum: int):
        super().__init__(RECORDS, CORRECT)
        self.at, self.signum = at, signum

    def generate(self, prompts, params):
        if len(self.calls) + 1 == self.at:
            os.kill(os.getpid(), self.signum)
        return super().generate(prompts, params)


@pytest.mark.parametrize("grace, signum, kept", [(20, signal.SIGTERM, 3), (0, signal.SIGINT, 2)])
def test_a_signal_keeps_the_finished_blocks_and_a_rerun_matches(tmp_path, grace, signum, kept):
    full = tmp_path / "full.jsonl"
    curate(full)
    out = tmp_path / "out.jsonl"
    with pytest.raises(Stopped) as info:
        curate(out, engine=SignallingEngine(3, signum), stop_grace_s=grace)
    assert signal.Signals(signum).name in str(info.value) and f"{kept} prompts curated" in str(info.value)
    assert [r["id"] for r in read_jsonl(out)] == [f"q{i}" for i in range(kept)]
    _, engine = curate(out)
    assert len(engine.calls) == len(RECORDS) - kept
    assert out.read_bytes() == full.read_bytes()
