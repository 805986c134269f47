"""Multi-turn environments (docs/environments.md): the interface (`base`), the table a recipe
names (`registry.ENVIRONMENTS`, ``env.name``), the ``env:`` section (`env_section`), the ``tools``
environment (`tool_env`), the tool layer (`tools`) and its sandbox (`sandbox`).

The episode loop around the rollout engines is `rltt.orchestration.episodes`."""

from rltt.environments.base import EnvReply, Environment
from rltt.environments.env_section import NO_ENV, EnvSection, ToolLimitsSection
from rltt.environments.registry import ENVIRONMENTS, make_environment

__all__ = ["ENVIRONMENTS", "EnvReply", "EnvSection", "Environment", "NO_ENV", "ToolLimitsSection", "make_environment"]
