"""The rollouts of a multi-turn step and of a partial-rollout step are, bit for bit, what they were
before the per-token row record (`rltt.rollout.rows.Row`) replaced the four records that came
before it.

`records()` digests every tensor of three batches — a multi-turn episode batch (native engine,
continued rows, thinking-free, a scripted tool), the same episodes with re-submitted turns
(`ContinuedTurns` off: every turn a new prompt), and the groups of a partial rollout generated in
two-token segments by the native engine, stitched and joined as a Ray driver joins them — and
the test compares them with ``data/row_records.json``. That file was written by this very module
run at the commit before the row record (``python -m tests.orchestration.test_row_records
--write``); every API it uses exists unchanged on both sides.

What the file pins is what every x86-64 CPU computes alike: the integer and boolean tensors (tokens,
exits, lengths, masks, kept-set sizes, versions), the finish reasons, the counts and the schedule's
shape, and of each float tensor its dtype, shape and NaN pattern. The float values themselves move
with the CPU's instruction set (MKL and ATen pick other kernels, which round otherwise), so they are
checked against a path computed here, on the running machine: the replay of the record, bit for bit,
where the record is replayable.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

DATA = Path(__file__).parent / "data" / "row_records.json"
TENSORS = ("prompt_index", "prompt_lengths", "completion_ids", "completion_lengths", "completion_mask",
           "exit_steps", "logprobs", "tempered_logprobs", "gate_probs", "forced_mask", "kept_floor",
           "exit_logprobs", "env_mask", "versions")


def _hash(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} " + hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:24]


def _digest(batch) -> dict:
    out = {}
    for name in TENSORS:
        t = getattr(batch, name)
        if t is None:
            out[name] = None
        elif t.is_floating_point():  # the values are checked on this machine (`_same_as_replay`)
            out[name] = f"{t.dtype} {tuple(t.shape)} nan " + _hash(t.isnan()).split(" ")[-1]
        else:
            out[name] = _hash(t)
    out["finish_reasons"] = list(batch.finish_reasons)
    out["prompts"] = hashlib.sha256(json.dumps(batch.prompts).encode()).hexdigest()[:24]
    stats = batch.stats
    out["stats"] = [stats.passes, stats.entries_computed, stats.entries_pending, stats.tokens,
                    None if stats.row_passes is None else stats.row_passes.tolist()]
    out["schedule"] = [batch.schedule.kind, batch.schedule.replayable, len(batch.schedule.passes),
                       batch.schedule.chunks]
    return out


def _episodes(continued: bool) -> dict:
    from rltt.orchestration.episodes import run_episodes
    from rltt.rollout import NativeEngine, SamplingParams

    from tests.environments.helpers import ScriptedEnv, decode, encode
    from tests.rollout.helpers import prompts, tiny_model

    engine = NativeEngine(tiny_model())
    if not continued:  # every turn re-submitted as a new prompt (the default of any engine)
        from rltt.rollout.engine import RolloutEngine

        engine.open_turns = lambda *a: RolloutEngine.open_turns(engine, *a)
    params = SamplingParams(temperature=1.0, top_k=40, max_new_tokens=6, n=2, prompt_seeds=[5, 17, 23],
                            stop_token_ids=[5, 6, 7, 8, 10], exit_policy="sample", schedule="deferred")
    episodes = run_episodes(engine, prompts([4, 6, 3], seed=2), params, ScriptedEnv((11, 12, 13)), ["a", "b", "c"],
                            encode, decode, max_turns=4, max_tokens=30)
    if episodes.rollout.schedule.replayable:
        _same_as_replay(engine.model, episodes.rollout)
    return _digest(episodes.rollout)


def _same_as_replay(model, batch) -> None:
    """The record's float values are the replay's, computed here, bit for bit."""
    from rltt.rollout import replay_logprobs

    replay = replay_logprobs(model, batch)
    for name in ("logprobs", "tempered_logprobs", "exit_logprobs"):
        assert torch.equal(getattr(replay, name).nan_to_num(), getattr(batch, name).nan_to_num()), name


def _partial() -> dict:
    from rltt.data.rewards import RewardRunner, WeightedReward
    from rltt.orchestration.prompt_stream import PromptStream
    from rltt.orchestration.ray.partial_rows import group_batch
    from rltt.orchestration.ray.partial_step import PartialStep
    from rltt.orchestration.ray.shards import merge
    from rltt.orchestration.train_recipe import TrainRecipe
    from rltt.rollout import NativeEngine

    from tests.rollout.helpers import VOCAB, tiny_model

    class Learner:  # never updates: every segment samples at version 0
        version, last_update_s = 0, 0.0

        def poll_update(self, wait: bool = False) -> bool:
            return True

    r = TrainRecipe()
    r.rollout.prompts_per_step, r.rollout.group_size, r.rollout.max_new_tokens = 3, 2, 7
    r.rollout.temperature, r.rollout.exit_policy = 1.0, "threshold:0.5"
    r.data.source = "synthetic:easy"
    r.orchestration.backend, r.orchestration.max_staleness, r.orchestration.partial_rollouts = "ray", 2, True
    r.train.steps = 1
    encode = lambda text: [1 + ord(c) % (VOCAB - 1) for c in text[:8]]  # noqa: E731
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    runner = RewardRunner([WeightedReward("length", lambda completion, answer, **kw: len(completion) / 20)])
    step = PartialStep(r, NativeEngine(tiny_model()), Learner(), PromptStream(r.data.source, encode, lambda q: q,
                       seed=r.data.seed), runner, decode, [], max_staleness=2, segment_tokens=2, last_step=1)
    step._admit()
    while step.flight:
        step._tick()
    groups = sorted(step.done, key=lambda g: g.index)
    params = step.sampling_base([g.seed for g in groups], r.rollout.group_size, r.rollout.max_new_tokens)
    parts = [group_batch(g, params, 4, torch.float32, 0, "deferred") for g in groups]
    return _digest(merge(parts, replace(params, seed=0), 0.0))


def records() -> dict:
    return {"episodes_continued": _episodes(True), "episodes_resubmitted": _episodes(False), "partial": _partial()}


def test_multi_turn_and_partial_rollouts_are_the_previous_records_bit_for_bit():
    want = json.loads(DATA.read_text())
    got = json.loads(json.dumps(records()))  # tuples as lists, as the file holds them
    for case in want:
        for key, value in want[case].items():
            assert got[case][key] == value, (case, key)


if __name__ == "__main__":
    if "--write" in sys.argv:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(records(), indent=1) + "\n")
    else:
        print(json.dumps(records(), indent=1))
