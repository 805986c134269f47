"""A tiny policy's token ids as text, and a scripted environment, for episode tests."""

from rltt.environments import EnvReply, Environment


def decode(ids) -> str:
    return "".join(f" {i}" for i in ids)


def encode(text: str) -> list[int]:
    return [int(t) for t in text.split()]


class ScriptedEnv(Environment):
    """A turn whose text holds a ``9`` (a token id with the digit: the "tool call", also the stop
    string) is answered with ``answer`` ids; any other turn ends the episode. ``crash_on``: a turn
    text containing it raises."""

    name = "scripted"
    stop_strings = ("9",)

    def __init__(self, answer=(11, 12, 13), crash_on: str | None = None):
        self.reply, self.crash_on = decode(answer), crash_on
        self.seen: list[str] = []

    def start(self, task):
        return {"task": task, "turns": 0}

    def step(self, state, turn):
        self.seen.append(turn)
        state["turns"] += 1
        if self.crash_on is not None and self.crash_on in turn:
            raise RuntimeError("scripted crash")
        if "9" not in turn:
            return EnvReply(None)
        return EnvReply(self.reply, tool_call=True, tool_error=state["turns"] % 2 == 0)
