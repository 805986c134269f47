"""Multi-turn episodes around any rollout engine: model turns, environment answers, one batch.

`run_episodes` samples through the engine's turn sessions (`RolloutEngine.open_turns`,
`rltt.rollout.turns`): every row's first turn in one call per session (the prompts, ``n`` rows
each, as a single-turn step would), then it hands each turn's text to the environment
(`rltt.environments.Environment.step`) and, where it answers, appends the answer's tokens to the
row and samples the row's next turn after *prompt + history* — the rows still going in one call
per turn, each with its own seed and budget. How a row goes on is the engine's: any engine by
default re-submits prompt + history as a new prompt (vLLM's prefix cache reuses the KV it has);
the native engine keeps each row's KV cache and decode state between turns and prefills only the
answer's tokens (`rltt.rollout.continuation`), and the episode batch then carries the pass record
of every turn (docs/environments.md).

The episode is one `RolloutBatch` row: the completion is the model's turns and the
environment's answers in order, ``env_mask`` marking the environment's tokens. A model token
keeps exactly what its turn recorded (exit step, raw and tempered log-probs, kept-set floor,
gates, exit log-prob), and the history it was sampled after is exactly the episode's tokens
before it (the environment's text is tokenized once and appended as ids, never re-tokenized
with its neighbours), so the learner, scoring the whole episode as one sequence, scores the
tokens the sampler drew in the context they were drawn in.

Limits: ``max_turns`` model turns; ``max_tokens`` completion tokens (model and environment
together). Each row's turn has its own budget left: continued rows stop at it; a re-submitting
call samples with the longest among its rows and a row's tokens past its own budget are cut off
afterwards — the kept tokens are a prefix of what was sampled, with their own records. An episode ends *truncated* (finish reason ``length``) when a turn stops at
a length cap, its budget leaves no room for the environment's answer and one more token, or the
last allowed turn still called a tool. A crash of the environment (an exception out of
``start``/``step``, or with an isolating ``env_runner`` a call that hangs or ends its worker
process: `rltt.environments.env_pool`) ends that episode with a counted error (scored 0), never
the run; tool calls run isolated under their own limits (`rltt.environments.tools`).

Seeds: turn 1 is the engine call with the step's ``params`` (``prompt_seeds``); row r's turn k > 1
draws from `turn_seed` (its prompt's seed, its sample index, k) — with one ``seed`` for the call
instead, (that seed, r, k) — so a row's episode depends on neither its batch-mates nor on when the
others end.

`replay_episode` re-executes the episode batch's pass record (continued rows) or every turn's
recorded passes (re-submitted native turns) and lays the log-probs out as the episode's: at the
rollout's weights it equals the episode's record bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from rltt.environments import Environment
from rltt.environments.env_pool import InProcessEnv
from rltt.rollout import RolloutBatch, RolloutEngine, SamplingParams
from rltt.rollout.replay import ReplayLogprobs, replay_logprobs
from rltt.rollout.rollout_batch import RolloutStats, Schedule, join_schedules
from rltt.rollout.rows import Row, rows_batch
from rltt.rollout.seeds import turn_seed
from rltt.rollout.turns import TurnSession

__all__ = ["EpisodeBatch", "TurnRecord", "run_episodes", "replay_episode"]


@dataclass
class TurnRecord:
    """One engine call of an episode batch: its `RolloutBatch` (row i's prompt is its episode's
    prompt + history), the episode row of each of its rows, the episode completion column of each
    row's first token, and how many of each row's tokens the episode kept (a prefix)."""

    batch: RolloutBatch
    rows: list[int]
    columns: list[int]
    kept: list[int]


@dataclass
class _Episode(Row):
    """One episode while it runs: its completion so far (the row record: each model turn taken from
    its engine call's batch, the environment's answers marked), its turns' text and its counts."""

    turns: list[str] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False
    error: str | None = None


@dataclass
class EpisodeBatch:
    """The episodes of one call: ``rollout`` (one row per episode, `RolloutBatch.env_mask` on the
    environment's tokens), ``answers`` (per row, the text the rewards score), per-row counts
    ``turns``, ``tool_calls``, ``tool_errors`` (long) and ``truncated`` (bool), ``errors`` (row ->
    message of an environment crash; that row scores 0) and, when kept, ``turns_record`` (the
    engine calls, for `replay_episode`)."""

    rollout: RolloutBatch
    answers: list[str]
    turns: torch.Tensor
    tool_calls: torch.Tensor
    tool_errors: torch.Tensor
    truncated: torch.Tensor
    errors: dict[int, str]
    turns_record: list[TurnRecord] | None = None

    def failed(self) -> torch.Tensor:
        """(R,) bool: the episodes an environment crash ended."""
        out = torch.zeros(self.rollout.num_rows, dtype=torch.bool)
        out[list(self.errors)] = True
        return out


def run_episodes(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams, env: Environment,
                 tasks: Sequence[Any], encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str],
                 max_turns: int, max_tokens: int, keep_turns: bool = False, env_runner=None) -> EpisodeBatch:
    """Run ``params.n`` episodes per prompt (``tasks[i]``: prompt i's data row, for
    `Environment.start`) and return them as one `EpisodeBatch` (rows prompt-major, as a single-turn
    rollout's). ``keep_turns``: keep every engine call's batch (for `replay_episode`). ``env_runner``:
    where the environment's calls run, one batch of them at a time (`rltt.environments.env_pool`:
    an `EnvPool`'s worker processes; None: this process)."""
    env_runner = env_runner if env_runner is not None else InProcessEnv(env)
    stops = list(params.stop_strings) + [s for s in env.stop_strings if s not in params.stop_strings]
    base = replace(params, stop_strings=stops, decoder=params.decoder or decode,
                   max_new_tokens=min(params.max_new_tokens, max_tokens))
    n = params.n
    episodes = [_Episode() for _ in range(len(prompts) * n)]
    records: list[TurnRecord] = []
    calls: list[tuple[RolloutBatch, list[int]]] = []  # each engine call and its episode rows
    parts: list[tuple[Schedule | None, int]] = []  # each turn session's pass record and rows
    # the engine's turn sessions (`RolloutEngine.open_turns`): re-submitted prompts or continued rows
    for session in engine.open_turns(list(prompts), base, max_tokens):
        with session:
            _session_episodes(session, list(prompts), base, env_runner, tasks, encode, decode, max_turns, max_tokens,
                              episodes, records, calls)
            parts.append((session.record(), session.end_row - session.first_row))
    answers = []
    for ep, (text, error) in zip(episodes, env_runner.answer([ep.turns for ep in episodes])):
        ep.error = ep.error or error  # an environment's own answer() that fails fails the episode
        answers.append(text or "")
    first = calls[0][0]
    schedules = [record for record, _ in parts]
    schedule = join_schedules(schedules, [k for _, k in parts]) if None not in schedules else None
    rollout = _episode_rollout(first, calls, episodes, replace(first.params, max_new_tokens=max_tokens),
                               list(prompts), schedule)
    return EpisodeBatch(
        rollout=rollout, answers=answers,
        turns=torch.tensor([len(ep.turns) for ep in episodes], dtype=torch.long),
        tool_calls=torch.tensor([ep.tool_calls for ep in episodes], dtype=torch.long),
        tool_errors=torch.tensor([ep.tool_errors for ep in episodes], dtype=torch.long),
        truncated=torch.tensor([ep.truncated for ep in episodes], dtype=torch.bool),
        errors={r: ep.error for r, ep in enumerate(episodes) if ep.error is not None},
        turns_record=records if keep_turns else None)


def _session_episodes(session: TurnSession, prompts: list[list[int]], base: SamplingParams, env_runner,
                      tasks: Sequence[Any], encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str],
                      max_turns: int, max_tokens: int, all_episodes: list[_Episode], records: list[TurnRecord],
                      calls: list[tuple[RolloutBatch, list[int]]]) -> None:
    """The episodes of one turn session (rows ``session.first_row ..`` of the call), turn by turn:
    their `_Episode`s filled in ``all_episodes``, their engine calls appended to ``records`` and
    ``calls`` (episode rows of the whole call). The environment's calls go through ``env_runner``,
    one batch per turn."""
    n = base.n
    offset, first_prompt = session.first_row, session.first_prompt
    prompts = prompts[first_prompt: session.end_prompt]
    tasks = tasks[first_prompt: session.end_prompt]
    first = session.first()
    T = first.num_loops
    R = first.num_rows
    # row r's (seed, index) its later turns draw from: its prompt's seed and sample index, or with
    # one seed for the call that seed and the row's index in it (as the engine keys turn 1's draws)
    per_prompt = first.params.prompt_seeds is not None
    keys = [(first.params.prompt_seeds[(offset + r) // n], r % n) if per_prompt else (first.params.seed, offset + r)
            for r in range(R)]
    episodes = all_episodes[offset: offset + R]
    states: list[Any] = [None] * R
    for r, (state, error) in enumerate(env_runner.start([tasks[r // n] for r in range(R)])):
        states[r], episodes[r].error = state, error  # an error: the episode fails before its first turn is read
    calls.append((first, list(range(offset, offset + R))))
    batch, rows = first, list(range(R))
    for turn in range(1, max_turns + 1):
        record = TurnRecord(batch, [offset + r for r in rows], [len(episodes[r]) for r in rows], [])
        going, asked = [], []
        for i, r in enumerate(rows):
            ep = episodes[r]
            sampled = int(batch.completion_lengths[i])
            keep = min(sampled, max_tokens - len(ep))
            record.kept.append(keep)
            ep.take(batch, i, keep)
            text = decode(batch.completion_ids[i, :keep].tolist())
            ep.turns.append(text)
            if ep.error is not None:
                continue
            if keep < sampled or batch.finish_reasons[i] == "length":
                ep.truncated = True
                continue
            asked.append((r, text))
        for (r, _), (step, error) in zip(asked, env_runner.step([states[r] for r, _ in asked], [t for _, t in asked])):
            ep = episodes[r]
            if error is not None:
                ep.error = error
                continue
            reply, states[r] = step
            if reply.done:
                continue
            ep.tool_calls += int(reply.tool_call)
            ep.tool_errors += int(reply.tool_error)
            answer = list(encode(reply.text))
            if turn == max_turns or len(ep) + len(answer) >= max_tokens:
                ep.truncated = True  # no turn left to read the answer, or no room for it and one more token
                continue
            ep.add_env(answer, T)
            going.append(r)
        records.append(record)
        session.release([r for r in rows if r not in going])  # their episodes ended
        if not going:
            break
        # each row's budget left; one call samples up to the longest (an engine that re-submits drops
        # a row's tokens past its own budget above, one that continues rows stops each at its own)
        caps = [min(base.max_new_tokens, max_tokens - len(episodes[r])) for r in going]
        call = replace(base, n=1, seed=None, max_new_tokens=max(caps),
                       prompt_seeds=[turn_seed(*keys[r], turn + 1) for r in going])
        batch = session.next(going, [list(prompts[r // n]) + episodes[r].ids for r in going], caps, call)
        rows = going
        calls.append((batch, [offset + r for r in rows]))


def _episode_rollout(first: RolloutBatch, calls: list[tuple[RolloutBatch, list[int]]], episodes: list[_Episode],
                     params: SamplingParams, prompts: list[list[int]], schedule: Schedule | None) -> RolloutBatch:
    """The episodes as one `RolloutBatch` (completion = every turn and answer in order); ``schedule``:
    the pass record of every turn when the engine kept one (continued rows), else none (not replayable)."""
    R = len(episodes)
    row_passes = None
    if all(c.stats.row_passes is not None for c, _ in calls):  # a row's serial passes: every call it was in
        row_passes = torch.zeros(R, dtype=first.stats.row_passes.dtype)
        for call, rows in calls:
            row_passes[torch.tensor(rows, dtype=torch.long)] += call.stats.row_passes
    done = [c.stats for c, _ in calls]  # the calls ran one after another
    stats = RolloutStats(passes=sum(s.passes for s in done), row_passes=row_passes,
                         entries_computed=sum(s.entries_computed for s in done),
                         entries_pending=sum(s.entries_pending for s in done),
                         tokens=sum(s.tokens for s in done), wall_time=sum(s.wall_time for s in done),
                         occupied=sum(s.occupied for s in done), occupied_passes=sum(s.occupied_passes for s in done),
                         waiting_occupied=sum(s.waiting_occupied for s in done),
                         waiting_passes=sum(s.waiting_passes for s in done))
    for ep in episodes:
        ep.finish = "length" if ep.truncated else "stop"
    return rows_batch(prompts, [r // params.n for r in range(R)], episodes,
                      schedule=schedule or Schedule(first.schedule.kind, [], replayable=False), params=params,
                      stats=stats, num_loops=first.num_loops, dtype=first.dtype, pad_id=first.pad_id)


def replay_episode(model, episodes: EpisodeBatch) -> ReplayLogprobs:
    """Every turn's recorded passes re-executed (`replay_logprobs`, native rollouts) and laid out as
    the episode's: raw, tempered and exit log-probs on the model's tokens, 0 on the environment's
    and on padding. Continued rows (the episode batch carries its turns' record): the episode batch
    replayed as it is; re-submitted turns: each turn's own batch, which needs the turns kept
    (``run_episodes(..., keep_turns=True)``)."""
    if episodes.rollout.schedule.replayable:
        replayed = replay_logprobs(model, episodes.rollout)
        model_tokens = episodes.rollout.action_mask
        return ReplayLogprobs(*(t.masked_fill(~model_tokens, 0.0) for t in
                                (replayed.logprobs, replayed.tempered_logprobs, replayed.exit_logprobs)))
    if episodes.turns_record is None:
        raise ValueError("replay_episode: the episodes were run without keep_turns=True")
    shape = episodes.rollout.logprobs.shape
    raw, tempered, exit_lp = (torch.zeros(shape, dtype=torch.float32) for _ in range(3))
    for record in episodes.turns_record:
        replayed = replay_logprobs(model, record.batch)
        for i, (r, column, keep) in enumerate(zip(record.rows, record.columns, record.kept)):
            raw[r, column:column + keep] = replayed.logprobs[i, :keep]
            tempered[r, column:column + keep] = replayed.tempered_logprobs[i, :keep]
            exit_lp[r, column:column + keep] = replayed.exit_logprobs[i, :keep]
    return ReplayLogprobs(raw, tempered, exit_lp)


@dataclass
class EpisodeRunner:
    """A recipe's episodes: its environment (``env.name``), its tokenizer's ``encode``/``decode``, the
    ``env.max_turns`` / ``env.max_tokens`` limits and where the environment's calls run
    (``env_runner``: the run's `EnvPool` with ``env.isolated``); `run` is `run_episodes` with them,
    `close` stops the pool's workers."""

    env: Environment
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    max_turns: int
    max_tokens: int
    env_runner: Any = None

    @classmethod
    def from_recipe(cls, recipe, encode, decode) -> "EpisodeRunner | None":
        """None without an environment (``env.name: none``, or a recipe with no ``env`` section)."""
        from rltt.environments import make_environment

        section = getattr(recipe, "env", None)
        env = make_environment(section) if section is not None else None
        if env is None:
            return None
        if encode is None:
            raise ValueError(f"env.name={section.name}: the episode loop needs the tokenizer's encode")
        return cls(env, encode, decode, section.max_turns, section.max_tokens, section.runner(env))

    def run(self, engine: RolloutEngine, tasks: Sequence[Any], params: SamplingParams,
            keep_turns: bool = False) -> EpisodeBatch:
        return run_episodes(engine, [t.prompt_ids for t in tasks], params, self.env, tasks, self.encode,
                            self.decode, self.max_turns, self.max_tokens, keep_turns, self.env_runner)

    def close(self) -> None:
        if self.env_runner is not None:
            self.env_runner.close()
