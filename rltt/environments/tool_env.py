"""The ``tools`` environment: a model turn may call a tool; the episode ends at a turn without a call.

Each turn's text goes to the tool layer (`rltt.environments.tools`): ``parse_tool_call`` finds
the call (None: no call, the turn is the final answer), ``run_tool`` runs it — the ``python``
tool in a sandboxed process of its own, under the episode's `ToolLimits` (a timeout, CPU,
memory, output) — and ``format_tool_result`` is the text the model sees after its turn. A
call that fails (timeout, exception, an unknown tool) is answered with its error text and
counted (``env/tool_errors``); the episode goes on. The reward is the recipe's reward on the
final answer (`Environment.answer`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from rltt.config import recipe_error
from rltt.environments import sandbox
from rltt.environments import tools as tool_layer
from rltt.errors import RlttError
from rltt.environments.base import Environment, EnvReply


class ToolEnvironment(Environment):
    """``tools``: the model may call any of ``tools`` (names of the tool table ``TOOLS``) under
    ``limits`` (a `ToolLimits`). ``toolkit``: the module (or object) with ``parse_tool_call``,
    ``run_tool``, ``format_tool_result`` and ``ToolResult`` — `rltt.environments.tools` unless given."""

    name = "tools"

    def __init__(self, tools: list[str], limits: Any = None,
                 stop_strings: tuple[str, ...] = (tool_layer.TOOL_CALL_END,), toolkit: Any = None):
        self.toolkit = toolkit if toolkit is not None else tool_layer
        limits = limits if limits is not None else tool_layer.ToolLimits()
        self.tools, self.limits, self.stop_strings = tuple(tools), limits, tuple(stop_strings)
        #: the python tool's isolation layers on this machine (None: the python tool is not used);
        #: the trainer writes them into the run directory (`rltt.telemetry.ISOLATION_FILE`)
        self.isolation: dict[str, bool] | None = None

    @classmethod
    def from_section(cls, section) -> "ToolEnvironment":
        """The run's environment; with the python tool, first the check that its sandbox has a
        kernel boundary here (`check_sandbox`)."""
        stops = (tool_layer.TOOL_CALL_END,) if section.stop_strings is None else tuple(section.stop_strings)
        env = cls(section.tools, section.limits.tool_limits(), stops)
        if "python" in env.tools:
            env.isolation = check_sandbox(getattr(getattr(section, "python", None), "unconfined", False))
        return env

    @staticmethod
    def check_section(section) -> None:
        """``env.tools``: a non-empty list of names of the tool table."""
        known = tuple(tool_layer.TOOLS)
        if not section.tools:
            raise recipe_error("env.tools", f"env.name=tools needs at least one tool of {' | '.join(known)}")
        for tool in section.tools:
            if tool not in known:
                raise recipe_error("env.tools", f"must be names of {' | '.join(known)}, got {tool!r}")

    def step(self, state: Any, turn: str) -> EnvReply:
        kit = self.toolkit
        call = kit.parse_tool_call(turn)
        if call is None:
            return EnvReply(None)
        name, source = call
        if name in self.tools:
            result = kit.run_tool(name, source, self.limits)
        else:
            # the error kind the tool layer gives what it does not run; the text names the tools
            result = kit.ToolResult(output=f"unknown tool {name!r}; the tools are: {', '.join(self.tools)}",
                                    error="unsupported", seconds=0.0)
        return EnvReply(kit.format_tool_result(result), tool_call=True, tool_error=result.error is not None)

    def __getstate__(self) -> dict:
        """A toolkit that is a module travels by its name (an isolated environment is pickled to its
        workers, `rltt.environments.env_pool`)."""
        state = dict(self.__dict__)
        if isinstance(self.toolkit, ModuleType):
            state["toolkit"] = _ModuleRef(self.toolkit.__name__)
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state.get("toolkit"), _ModuleRef):
            state["toolkit"] = importlib.import_module(state["toolkit"].name)
        self.__dict__.update(state)


UNCONFINED_KEY = "env.python.unconfined"


def check_sandbox(unconfined: bool) -> dict[str, bool]:
    """The python tool's isolation layers here (`sandbox.isolation`); refuses, in one line naming
    the missing layer, what to install and `UNCONFINED_KEY`, when the kernel boundary is missing
    and the recipe did not opt out."""
    reason = sandbox.refusal(UNCONFINED_KEY)
    if reason is not None and not unconfined:
        raise RlttError(f"env.tools: {reason}")
    layers = sandbox.isolation()
    layers["unconfined_opt_out"] = bool(unconfined and reason is not None)
    return layers


@dataclass(frozen=True)
class _ModuleRef:
    name: str
