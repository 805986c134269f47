"""The ``annotations`` environment: GSM8K's calculator, on the annotations a GSM8K-format model writes.

A GSM8K solution line reads ``Ann has 7+5 = <<7+5=12>>12 apples.``: the model opens a
calculator annotation ``<<EXPR=`` and the value follows. Here a model turn ends at an ``=``
(the stop string). A turn that ends inside an open annotation ``<<EXPR=`` is a calculator call:
the environment answers with EXPR's exact value and the closing ``>>`` (the ``calculator`` tool of
`rltt.environments.tools`, bounded, in-process), and the model goes on from there — it can copy
the value into its line and its final ``#### N`` instead of computing it. A turn that ends at an
``=`` outside an annotation (``7+5 =``) is answered with nothing (no call; the model goes on). A
turn that ends any other way (EOS, a length cap) ends the episode; its reward is the recipe's on
the last turn, which holds the final ``#### N``.

A model pretrained on GSM8K-format text writes these annotations already, so a small model calls
this calculator from its first step — unlike a tag syntax it has never seen.
"""

from __future__ import annotations

from typing import Any

from rltt.config import recipe_error
from rltt.environments import tools as tool_layer
from rltt.environments.base import Environment, EnvReply

OPEN, CLOSE, EQUALS = "<<", ">>", "="


class AnnotationEnvironment(Environment):
    """``annotations``: ``<<EXPR=`` answered with ``VALUE>>`` under ``limits`` (a `ToolLimits`); a
    failed evaluation is answered ``?>>`` and counted as a tool error."""

    name = "annotations"
    stop_strings = (EQUALS,)

    def __init__(self, limits: Any = None):
        self.limits = limits if limits is not None else tool_layer.ToolLimits()

    @classmethod
    def from_section(cls, section) -> "AnnotationEnvironment":
        return cls(section.limits.tool_limits())

    @staticmethod
    def check_section(section) -> None:
        """The calculator is the one tool (``env.tools`` is not read); a turn ends at ``=``."""
        if section.stop_strings is not None and list(section.stop_strings) != [EQUALS]:
            raise recipe_error("env.stop_strings", f"env.name=annotations ends a turn at {EQUALS!r} "
                                                   f"(leave it null), got {section.stop_strings!r}")

    def step(self, state: Any, turn: str) -> EnvReply:
        if not turn.endswith(EQUALS):
            return EnvReply(None)  # EOS or a length cap: the episode's last turn
        start = turn.rfind(OPEN)
        if start < 0 or CLOSE in turn[start:]:
            return EnvReply("")  # an "=" outside an annotation: nothing to answer, the model goes on
        result = tool_layer.run_tool("calculator", turn[start + len(OPEN):-len(EQUALS)], self.limits)
        value = result.output.strip() if result.error is None else "?"
        return EnvReply(f"{value}{CLOSE}", tool_call=True, tool_error=result.error is not None)
