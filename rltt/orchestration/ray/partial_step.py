"""The Ray driver's training step with ``orchestration.partial_rollouts``: asynchronous RL for
long-tail completion lengths (docs/async.md).

A buffer holds up to K · P groups (K = ``orchestration.max_staleness``, P =
``rollout.prompts_per_step``) admitted from the prompt stream and not yet trained. The driver
generates every unfinished row of the buffer one segment (``orchestration.partial_segment_tokens``)
at a time (`rltt.orchestration.ray.partial_rows`); between segments it tops the buffer up, drops
stale groups and, while the learner updates, polls it: once the update is done the new weights are
published to the rollout workers at once, and the rows still generating continue under them.

Step n takes the first P groups to complete (the oldest first version first, then admission
order), so a long row no longer holds its step back. A group with a token more than K versions
behind the learner — its first segment's, the oldest — is dropped with all its rows, counted in
``orchestration/dropped_rows`` and never trained on; a dropped group's place is refilled from the
stream. Every prompt the stream hands out is trained on or dropped exactly once: the buffer
(tokens so far, per-token versions and log-probs) is part of the checkpoint, so ``--resume``
continues the very groups in flight and the stream where it stopped.

Per step: ``orchestration/staleness`` is the most, ``staleness_mean`` the mean over the batch's
tokens of (learner version − the token's version); ``partial_rows`` the rows spanning several
versions; ``learner_idle_frac`` / ``rollout_idle_frac`` the shares of the step's wall time the
learner ran no update / no generate call was in flight.

Which groups complete first depends on timing, so such a run is not bitwise reproducible.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace

import torch

from rltt.orchestration.groups import score_rollout
from rltt.orchestration.policy import sampling_params
from rltt.orchestration.ray import shards
from rltt.orchestration.ray.overlap import idle_fraction
from rltt.orchestration.ray.partial_rows import Group, PartialRow, group_batch
from rltt.orchestration.step import TrainingStep, rollout_metrics
from rltt.rollout.seeds import rollout_seed, segment_seed
from rltt.rollout import SamplingParams
from rltt.telemetry import schema as m

#: The ``step`` part of a partial-rollout group's seed, keyed by its stream position: no step of a run is -1.
SEED_STEP = -1


class PartialStep(TrainingStep):
    """`TrainingStep` whose rollout takes completed groups from a buffer generated in segments
    across weights versions (the module docstring)."""

    def __init__(self, *args, max_staleness: int = 1, segment_tokens: int = 32, last_step: int = 0,
                 max_positions: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_staleness, self.segment_tokens, self.last_step = int(max_staleness), int(segment_tokens), last_step
        self.max_positions = max_positions  # the model's positions (a thinking budget's rule needs them)
        self.flight: list[Group] = []  # admitted, still generating, in admission order
        self.done: list[Group] = []  # complete, not trained yet
        self.admitted = 0  # groups admitted so far (the next one's index)
        self.taken = 0  # groups trained on so far
        self.dropped_rows = 0  # since the last batch was formed
        self.dropped: list[Group] = []  # the groups dropped since the last batch, without their rows
        self.gen_s = 0.0  # seconds with a generate call in flight, this step
        self.trained: list[Group] = []  # the groups of the last batch formed
        self._kind, self._dtype, self._loops = "deferred", torch.float32, None  # as the engine reports them
        self.learner.during_update = self._during_update

    # -- settings ---------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        return self.recipe.rollout.group_size

    def sampling_base(self, seeds: list[int], n: int, max_new_tokens: int) -> SamplingParams:
        """The run's sampling settings for ``seeds`` (one per prompt), ``n`` rows each, at most
        ``max_new_tokens`` — a segment's call: without the thinking budget, which the rows count
        across their segments (`PartialRow.append_segment`)."""
        return sampling_params(self.recipe.rollout, self.stop_token_ids, self.decode, None,
                               seed=rollout_seed(self.recipe.seed, SEED_STEP, 0, -1), prompt_seeds=list(seeds),
                               n=n, max_new_tokens=max_new_tokens)

    # -- the buffer -------------------------------------------------------------------------
    def _room(self) -> int:
        """Groups the buffer may admit now: up to K · P held, and none the run will not train."""
        total = self.recipe.rollout.prompts_per_step
        room = self.max_staleness * total - len(self.flight) - len(self.done)
        if self.last_step:
            room = min(room, self.last_step * total - self.taken - len(self.flight) - len(self.done))
        return max(room, 0)

    def _admit(self) -> None:
        room = self._room()
        if not room:
            return
        for task in self.prompts.next(room):
            self.flight.append(Group(self.admitted, task, rollout_seed(self.recipe.seed, SEED_STEP, 0, task.index)))
            self.admitted += 1

    def _drop_stale(self) -> None:
        """Drop the groups with a token more than K versions behind the learner (they never can be
        trained on: the learner's version only grows)."""
        floor = self.learner.version - self.max_staleness
        for pool in (self.flight, self.done):
            stale = [g for g in pool if g.first_version is not None and g.first_version < floor]
            for g in stale:
                pool.remove(g)
                self.dropped.append(replace(g, rows=[]))  # its prompt, for the count: the rows are freed
                self.dropped_rows += len(g.rows)

    def _tick(self) -> None:
        """One segment of every unfinished row in the buffer, at the version the engine serves now."""
        version = self.engine.weights_version
        limit = self.recipe.rollout.max_new_tokens
        base = self.sampling_base([], self.group_size, limit)
        calls = []  # (prompts, params, [(group, row index or None)], asked)
        new = [g for g in self.flight if not g.started]
        if new:
            asked = min(self.segment_tokens, limit if self.thinking is None else self.thinking.budget)
            calls.append(([list(g.task.prompt_ids) for g in new], self.sampling_base([g.seed for g in new],
                                                                                     self.group_size, asked),
                          [(g, None) for g in new], asked))
        by_asked = defaultdict(list)
        for g in self.flight:
            for j, row in enumerate(g.rows):
                if row.finish is None:
                    by_asked[min(self.segment_tokens, row.limit(base, self.thinking) - len(row))].append((g, j))
        for asked, rows in sorted(by_asked.items()):
            prompts = [list(g.task.prompt_ids) + g.rows[j].ids for g, j in rows]
            seeds = [segment_seed(g.seed, j, g.rows[j].segments) for g, j in rows]
            calls.append((prompts, self.sampling_base(seeds, 1, asked), rows, asked))
        if not calls:
            return
        t0 = time.perf_counter()
        batches = self._generate([(prompts, params) for prompts, params, _, _ in calls])
        self.gen_s += time.perf_counter() - t0
        for (_, _, rows, asked), batch in zip(calls, batches):
            if rows and rows[0][1] is None:  # first segments: the group's n rows, prompt-major
                for i, (g, _) in enumerate(rows):
                    g.first_version = version
                    g.rows = [PartialRow() for _ in range(self.group_size)]
                    for j, row in enumerate(g.rows):
                        row.append_segment(batch, i * self.group_size + j, version, asked, base, self.thinking,
                                   self._positions(g))
            else:
                for r, (g, j) in enumerate(rows):
                    g.rows[j].append_segment(batch, r, version, asked, base, self.thinking, self._positions(g))
            self._kind, self._dtype, self._loops = batch.schedule.kind, batch.dtype, batch.num_loops
        for g in [g for g in self.flight if g.done]:
            self.flight.remove(g)
            self.done.append(g)

    def _positions(self, group: Group) -> int | None:
        """The completion positions the model has after the group's prompt (None: not known)."""
        return None if self.max_positions is None else self.max_positions - len(group.task.prompt_ids)

    def _generate(self, calls):
        """The calls' batches: dispatched together when the engine can (a `RayRolloutPool`)."""
        if hasattr(self.engine, "submit"):
            pending = [self.engine.submit(prompts, params) for prompts, params in calls]
            return [p.result() for p in pending]
        return [self.engine.generate(prompts, params) for prompts, params in calls]

    # -- the step ----------------------------------------------------------------------------
    def _during_update(self) -> None:
        """While the learner updates: generate segments; once the update is done, publish its weights
        to the rollout workers and return (the rows in flight continue under them next step)."""
        while True:
            if self.learner.poll_update():
                if self.learner.version != self.engine.weights_version:
                    self.engine.load_weights(*self.learner.rollout_state_dict())
                return
            self._drop_stale()
            self._admit()
            if not self.flight:
                return  # nothing to generate: the rollout workers wait for the update
            self._tick()

    def rollout(self, step: int):
        total = self.recipe.rollout.prompts_per_step
        self._drop_stale()
        self._admit()
        while len(self.done) < total:  # the learner waits for completed groups
            if not self.flight:
                raise RuntimeError(f"partial rollouts: {len(self.done)} of {total} groups complete and none "
                                   f"generating (admission stopped)")
            self._tick()
            self._drop_stale()
            self._admit()
        take = sorted(self.done, key=lambda g: (g.first_version, g.index))[:total]
        self.done = [g for g in self.done if g not in take]
        self.taken += len(take)
        return self._scored(take)

    def _scored(self, take: list[Group]):
        base = replace(self.sampling_base([g.seed for g in take], self.group_size, self.recipe.rollout.max_new_tokens),
                       thinking=self.thinking)  # the rows' settings, as one call with the budget would have them
        parts = [group_batch(g, base, self._loops, self._dtype, self.pad_id, self._kind) for g in take]
        rollout = shards.merge(parts, base, 0.0)
        tasks = [g.task for g in take]
        scored = score_rollout(rollout, tasks, self.decode, self.runner)
        groups = self.score(scored, base.prompt_seeds)  # the KL in the reward measured now, between updates
        metrics = rollout_metrics(scored, groups, self.ranks, self.runner.names[0], self.thinking)
        batch = groups.batch
        keep = batch.target_mask
        behind = (self.learner.version - batch.versions[keep]).float()
        metrics[m.ORCH_STALENESS] = int(behind.max()) if behind.numel() else 0
        metrics[m.ORCH_STALENESS_MEAN] = float(behind.mean()) if behind.numel() else 0.0
        metrics[m.ORCH_PARTIAL_ROWS] = sum(row.versions_spanned() > 1 for g in take for row in g.rows)
        metrics[m.ORCH_DROPPED_ROWS] = self.dropped_rows
        self.trained, self.dropped_rows, self.last_dropped, self.dropped = take, 0, self.dropped, []
        # the learner's version now is the one the update starts from: the staleness it trains at
        return groups, metrics

    def __call__(self, step: int) -> dict[str, float]:
        self.gen_s = 0.0
        metrics = super().__call__(step)
        window = metrics[m.TIME_STEP]
        tokens = int(self.trained_tokens())
        metrics[m.THROUGHPUT_TOKENS_PER_S] = tokens / max(window, 1e-9)  # the batch's tokens per second of step
        metrics[m.ORCH_LEARNER_IDLE_FRAC] = idle_fraction(self.learner.last_update_s, window)
        metrics[m.ORCH_ROLLOUT_IDLE_FRAC] = idle_fraction(self.gen_s, window)
        log = getattr(self.engine, "log", None)
        if log is not None:
            metrics[m.ORCH_WORKER_RESTARTS] = log.restarts("rollout")
            metrics[m.ORCH_REISSUED_SHARDS] = self.engine.reissued
        return metrics

    def trained_tokens(self) -> int:
        return sum(len(row) for g in self.trained for row in g.rows)

    # -- checkpoint --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The buffer (tokens so far, per-token versions and log-probs of every row) and its counters."""
        return {"partial": {"flight": [g.plain() for g in self.flight], "done": [g.plain() for g in self.done],
                            "admitted": self.admitted, "taken": self.taken, "dropped_rows": self.dropped_rows,
                            "dropped": [g.plain() for g in self.dropped],
                            "kind": self._kind, "dtype": str(self._dtype), "loops": self._loops}}

    def load_state_dict(self, state: dict) -> None:
        plain = state.get("partial")
        if plain is None:
            return
        self.flight = [Group.from_plain(g) for g in plain["flight"]]
        self.done = [Group.from_plain(g) for g in plain["done"]]
        self.admitted, self.taken, self.dropped_rows = plain["admitted"], plain["taken"], plain["dropped_rows"]
        self.dropped = [Group.from_plain(g) for g in plain.get("dropped", [])]
        self._kind, self._loops = plain["kind"], plain["loops"]
        self._dtype = getattr(torch, plain["dtype"].removeprefix("torch."))
