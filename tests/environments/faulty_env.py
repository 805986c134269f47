"""Environments for the isolation tests: a scripted environment that faults on one task (it raises,
hangs, exits, is killed, segfaults or allocates without bound), and a small text vocabulary in
which a tiny random model writes calculator annotations and tool calls often. Kept apart from the
tests (and torch-free): a worker process imports this module to unpickle the environment."""

import ctypes
import os
import signal
import time

from .helpers import ScriptedEnv


def _raise():
    raise RuntimeError("scripted fault")


def _hang():
    time.sleep(3600)


def _exit():
    os._exit(3)


def _sigkill():
    os.kill(os.getpid(), signal.SIGKILL)


def _segfault():
    ctypes.string_at(0)


def _allocate():
    hoard = []
    while True:
        hoard.append(bytearray(64 << 20))


#: fault -> what the environment's call does
FAULTS = {"raise": _raise, "hang": _hang, "exit": _exit, "sigkill": _sigkill, "segfault": _segfault,
          "memory": _allocate}


class FaultyEnv(ScriptedEnv):
    """`ScriptedEnv`, but its ``at`` call (``start`` or ``step``) of an episode on ``task`` (a data
    row's id, or the task itself) runs the fault ``fault`` (a key of `FAULTS`) instead."""

    name = "faulty"

    def __init__(self, fault: str | None = None, task=None, at: str = "step"):
        super().__init__()
        self.fault, self.task, self.at = fault, task, at

    def start(self, task):
        if self.fault is not None and self.at == "start" and getattr(task, "id", task) == self.task:
            FAULTS[self.fault]()
        return super().start(task)

    def step(self, state, turn):
        if self.fault is not None and self.at == "step" and getattr(state["task"], "id", state["task"]) == self.task:
            FAULTS[self.fault]()
        return super().step(state, turn)


class UnpicklableState(FaultyEnv):
    """Its episode on ``task`` has a state that does not pickle."""

    def start(self, task):
        state = super().start(task)
        if task == self.task:
            state["hook"] = lambda: None
        return state


class OwnAnswer(FaultyEnv):
    """Scores every turn, joined; raises on an episode of one turn."""

    def answer(self, turns):
        if len(turns) == 1:
            raise ValueError("one turn")
        return "|".join(turns)


class Vocabulary:
    """A piece of text per token id of the tiny test models (several ids share a piece, so a random
    model writes the frequent ones often); `encode` matches the longest piece, and a character no
    piece starts with is ``?``."""

    def __init__(self, pieces: list[str], size: int = 61):
        filler = [str(d) for d in range(10)] + ["+", "*"]
        self.pieces = list(pieces) + [filler[i % len(filler)] for i in range(size - len(pieces))]
        self.first: dict[str, int] = {}
        for i, piece in enumerate(self.pieces):
            self.first.setdefault(piece, i)
        self.longest = max(len(p) for p in self.first)

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        out, at = [], 0
        while at < len(text):
            for size in range(min(self.longest, len(text) - at), 0, -1):
                if text[at:at + size] in self.first:
                    out.append(self.first[text[at:at + size]])
                    at += size
                    break
            else:
                out.append(self.first["?"])
                at += 1
        return out


_BASE = [str(d) for d in range(10)] + ["+", "*", "-", "/", " ", "\n", "#", "?"]
#: GSM8K calculator annotations: "<<" opens one, a turn ends at "=" (the annotations environment)
ANNOTATIONS = Vocabulary(_BASE + ["<<"] * 12 + ["="] * 8 + [">>"])
#: tagged tool calls: a turn ends at "</tool>" (the tools environment), the result comes back tagged
TOOL_CALLS = Vocabulary(_BASE + ['<tool name="calculator">'] * 10 + ["</tool>"] * 10
                        + ['<tool name="python">print('] * 2 + [")"] * 2 + ["<tool_result>", "</tool_result>"])
