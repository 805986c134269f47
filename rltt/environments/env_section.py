"""The ``env:`` recipe section: which environment runs a multi-turn episode and its limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rltt.config import PositiveFloat, PositiveInt, Range, recipe_error
from rltt.environments.env_pool import MIN_ENV_MEMORY_MB, EnvPool, InProcessEnv
from rltt.environments.registry import ENVIRONMENTS
from rltt.environments.tools import MIN_MEMORY_MB, MIN_OUTPUT_CHARS, ToolLimits

#: ``env.name`` without an environment: every row is one completion, the single-turn step
NO_ENV = "none"


@dataclass
class ToolLimitsSection:
    """``env.limits``: what one tool call may use (`rltt.environments.tools.ToolLimits`):
    wall-clock ``timeout_s``, ``cpu_s`` of CPU time, ``memory_mb`` of address space, and the
    ``output_chars`` of its output the model is shown."""

    timeout_s: PositiveFloat = 5.0
    cpu_s: PositiveFloat = 5.0
    memory_mb: Annotated[int, Range(ge=MIN_MEMORY_MB, why="the interpreter itself needs that much")] = 512
    output_chars: Annotated[int, Range(ge=MIN_OUTPUT_CHARS, why="room for the truncation marker")] = 1024

    def tool_limits(self) -> ToolLimits:
        return ToolLimits(timeout_s=self.timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb,
                          output_chars=self.output_chars)


@dataclass
class PythonToolSection:
    """``env.python``: the ``python`` tool's sandbox. ``unconfined: true`` runs tool code even where
    the kernel layers (bubblewrap's namespaces and the seccomp filter) do not apply — only the
    audit hook, the resource limits and Landlock (where present) remain. Without it, a run with
    the python tool on such a machine stops at start naming the missing layer (docs/tools.md)."""

    unconfined: bool = False


@dataclass
class EnvSection:
    """``env.name``: ``none`` (single-turn: the model answers once) or a key of the environment
    table (``tools``: a model turn may call one of ``env.tools``; the episode ends at a turn
    without a call). ``max_turns``: model turns per episode; ``max_tokens``: the episode's
    completion budget, model and environment tokens together (each model turn is further capped
    by ``rollout.max_new_tokens``); an episode that runs out of either ends *truncated*.
    ``stop_strings``: where a model turn ends besides EOS (null: the environment's own — ``tools``:
    the tool-call close tag ``</tool>``; ``annotations``: ``=``).
    ``limits``: per tool call. ``python``: the python tool's sandbox (``env.python.unconfined``).

    ``isolated``: the environment's own calls (``start``, ``step``, ``answer``) run in ``workers``
    worker processes (null: half the CPUs, 1 to 4), each call within ``timeout_s`` seconds and each
    worker within ``memory_mb`` of address space; a call that raises, hangs or ends its process
    fails its episode only (`rltt.environments.env_pool`). ``false``: in the trainer's process."""

    name: Literal[(NO_ENV, *ENVIRONMENTS)] = NO_ENV  # type: ignore[valid-type]  # the environment table's names
    tools: list[str] = field(default_factory=lambda: ["python"])
    max_turns: Annotated[int, Range(ge=1, le=64)] = 4
    max_tokens: PositiveInt = 512
    stop_strings: list[str] | None = None  # null: the environment's own (tools: the call's close tag)
    limits: ToolLimitsSection = field(default_factory=ToolLimitsSection)
    python: PythonToolSection = field(default_factory=PythonToolSection)
    isolated: bool = True  # start/step/answer in worker processes (false: in the trainer's process)
    workers: PositiveInt | None = None  # isolated: worker processes (null: half the CPUs, 1 to 4)
    timeout_s: PositiveFloat = 30.0  # isolated: seconds one environment call may take (a tool call included)
    memory_mb: Annotated[int, Range(ge=MIN_ENV_MEMORY_MB, why="the interpreter and the tool layer need that much")] = 4096

    @property
    def enabled(self) -> bool:
        return self.name != NO_ENV

    def validate(self) -> None:
        if not self.enabled:
            return
        if self.stop_strings is not None and any(not s for s in self.stop_strings):
            raise recipe_error("env.stop_strings", "must be non-empty strings")
        if self.isolated and self.timeout_s <= self.limits.timeout_s:
            raise recipe_error("env.timeout_s", f"must be longer than env.limits.timeout_s={self.limits.timeout_s:g} "
                                                f"(an environment call runs a tool call within it), got "
                                                f"{self.timeout_s:g}")
        ENVIRONMENTS[self.name].check_section(self)

    def check_rollout(self, rollout, orchestration) -> None:
        """What the episode loop needs of the other sections (called from the train recipe)."""
        if not self.enabled:
            return
        if rollout.max_new_tokens > self.max_tokens:
            raise recipe_error("rollout.max_new_tokens", f"a model turn's cap must be <= env.max_tokens="
                                                         f"{self.max_tokens} (the whole episode's), got "
                                                         f"{rollout.max_new_tokens}")
        if rollout.thinking.budget:
            raise recipe_error("rollout.thinking.budget", f"must be 0 with env.name={self.name} (a thinking "
                                                          f"budget is per completion, an episode has several turns)")
        if orchestration.backend != "local":
            raise recipe_error("orchestration.backend", f"env.name={self.name} runs episodes with the local "
                                                        f"orchestration only, got {orchestration.backend!r}")

    def check_positions(self, prompt_tokens: int, max_positions: int | None) -> None:
        """An episode's last turn is prompted with the prompt and the whole history: the prompt
        budget (``data.max_prompt_tokens``) + ``env.max_tokens`` must fit the model's positions
        (None: not known yet — the trainer checks each prompt once the model is there)."""
        if not self.enabled or max_positions is None:
            return
        if prompt_tokens + self.max_tokens > max_positions:
            raise recipe_error("env.max_tokens", f"data.max_prompt_tokens={prompt_tokens} + env.max_tokens="
                                                 f"{self.max_tokens} = {prompt_tokens + self.max_tokens} positions "
                                                 f"exceed the model's max_position_embeddings={max_positions} (an "
                                                 f"episode's last turn runs on the prompt and the whole history)")

    def runner(self, env):
        """Where ``env``'s calls run: an `EnvPool` (``isolated``) or `InProcessEnv`."""
        if not self.isolated:
            return InProcessEnv(env)
        return EnvPool(env, self.workers, self.timeout_s, self.memory_mb)
