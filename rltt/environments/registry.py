"""The environments a recipe can name (``env.name``): a table ``{name: class}``.

An entry is a class of `rltt.environments.base.Environment` with ``from_section(env_section)``
(build it from the recipe's ``env:`` section) and ``check_section(env_section)`` (one-line
recipe errors for what it needs of the section, checked when the recipe loads).
"""

from __future__ import annotations

from rltt.environments.annotation_env import AnnotationEnvironment
from rltt.environments.tool_env import ToolEnvironment

ENVIRONMENTS = {
    "tools": ToolEnvironment,  # <tool name="…">…</tool> calls of env.tools (python, calculator)
    "annotations": AnnotationEnvironment,  # GSM8K calculator annotations <<EXPR= answered VALUE>>
}


def make_environment(section):
    """The environment of an ``env:`` section, or None for ``env.name: none`` (single-turn)."""
    if not section.enabled:
        return None
    return ENVIRONMENTS[section.name].from_section(section)
