"""Turn sessions: how a rollout engine samples the turns of multi-turn episodes.

An episode loop (`rltt.orchestration.episodes.run_episodes`) asks its engine for *sessions*
(`RolloutEngine.open_turns`): each covers consecutive whole prompts of the call (rows
``first_row .. end_row − 1`` of it, ``n`` per prompt) and samples their turns one engine call after
another:

- `TurnSession.first`: the rows' first turn, as ``engine.generate(prompts, params)`` would sample it;
- `TurnSession.next`: the next turn of some of its rows, each after ``sequence`` — its prompt and
  the episode so far (its turns and the environment's answers) — with its own completion budget
  and its own seed (``params.prompt_seeds``, one per row, ``n = 1``);
- `TurnSession.release`: rows whose episode ended (never continued again);
- `TurnSession.record`: the pass record of every turn as one replayable `Schedule` of the
  session's rows (rows numbered from 0), or None when the engine keeps none;
- `TurnSession.close`: free what the session holds.

What an engine does with a continued row is its own: `ResubmitTurns` (every engine's default)
re-submits the row's sequence as a new prompt — the engine recomputes the history's KV, or reuses
it from a prefix cache (vLLM) — and keeps no record across turns; the native engine keeps its
rows' KV cache and decode state between turns and prefills only the appended tokens
(`rltt.rollout.continuation`). The episode loop does not know which one it drives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import TYPE_CHECKING

from rltt.rollout.params import SamplingParams
from rltt.rollout.rollout_batch import RolloutBatch, Schedule

if TYPE_CHECKING:
    from rltt.rollout.engine import RolloutEngine

__all__ = ["ResubmitTurns", "TurnSession"]


class TurnSession(ABC):
    """The turns of rows ``first_row .. end_row − 1`` of an episode call (prompts
    ``first_prompt .. end_prompt − 1``); row indices given to `next` / `release` count from 0 in the
    session. Closing it twice is harmless; it is a context manager."""

    first_prompt: int
    end_prompt: int
    first_row: int
    end_row: int

    @abstractmethod
    def first(self) -> RolloutBatch:
        """The first turn of every row of the session (its prompts, ``params.n`` rows each)."""

    @abstractmethod
    def next(self, rows: list[int], sequences: list[list[int]], caps: list[int],
             params: SamplingParams) -> RolloutBatch:
        """The next turn of ``rows``: row ``rows[i]`` goes on after ``sequences[i]`` (its prompt,
        every token it sampled and every token appended to it, in order) with at most ``caps[i]``
        new tokens; ``params`` has ``n = 1`` and ``prompt_seeds`` one seed per row. The batch's
        row i is ``rows[i]``, its prompt ``sequences[i]``."""

    def release(self, rows: list[int]) -> None:
        """``rows`` will not be continued (their episode ended)."""

    def record(self) -> Schedule | None:
        """Every pass of every turn, replayable as one batch of the session's rows (None: none kept)."""
        return None

    def close(self) -> None:
        """Free what the session holds."""

    def __enter__(self) -> "TurnSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ResubmitTurns(TurnSession):
    """Any engine's turns: a continued row is a new prompt (its whole sequence) in a new
    ``generate`` call, with the longest budget any of its rows has (a row's tokens past its own
    budget are the caller's to drop). One session covers every prompt of the call."""

    def __init__(self, engine: "RolloutEngine", prompts: list[list[int]], params: SamplingParams):
        self.engine, self.prompts, self.params = engine, prompts, params
        self.first_prompt, self.end_prompt = 0, len(prompts)
        self.first_row, self.end_row = 0, len(prompts) * params.n

    def first(self) -> RolloutBatch:
        return self.engine.generate(self.prompts, self.params)

    def next(self, rows: list[int], sequences: list[list[int]], caps: list[int],
             params: SamplingParams) -> RolloutBatch:
        return self.engine.generate([list(s) for s in sequences], replace(params, max_new_tokens=max(caps)))
