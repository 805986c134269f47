"""The environment interface of a multi-turn episode (`rltt.orchestration.episodes` runs it).

An episode starts from a data row (`Environment.start` gets the row's task and returns the
episode's state), then alternates: the model samples a turn, the environment reads the turn's
text (`Environment.step`) and either answers with text — a tool's result, a user message —
that is appended to the episode as *environment tokens* (context for the model's next turn,
never trained on), or ends the episode. The episode's reward is the recipe's reward functions
(``rewards:``) on the text `Environment.answer` picks (by default the last model turn).

What flows back is an `EnvReply`. An environment never sees token ids: the episode loop
tokenizes its text and keeps the model's tokens exactly as sampled.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence


@dataclass(frozen=True)
class EnvReply:
    """The environment's answer to one model turn.

    ``text``: appended after the turn (the environment's tokens), or None: the episode ends
    here. ``tool_call``: the turn called a tool; ``tool_error``: that call failed (timeout, limit,
    exception, unknown tool — the result text says which, and the episode goes on)."""

    text: str | None
    tool_call: bool = False
    tool_error: bool = False

    @property
    def done(self) -> bool:
        return self.text is None


class Environment(ABC):
    """A multi-turn environment a recipe names (``env.name``, a key of
    `rltt.environments.ENVIRONMENTS`).

    ``stop_strings``: where a model turn ends besides EOS (e.g. the tool-call close tag); the
    engines stop there (`SamplingParams.stop_strings`, tokens kept whole)."""

    name: ClassVar[str]
    stop_strings: tuple[str, ...] = ()

    def start(self, task: Any) -> Any:
        """The state of a new episode on ``task`` (the data row: prompt, answer, id); None by default."""
        return None

    @abstractmethod
    def step(self, state: Any, turn: str) -> EnvReply:
        """Read the model's turn ``turn`` (its decoded text) and answer it or end the episode."""

    def answer(self, turns: Sequence[str]) -> str:
        """The text the recipe's rewards score once the episode ended (``turns``: the model's turns,
        in order): the last one, the final answer."""
        return turns[-1] if turns else ""
