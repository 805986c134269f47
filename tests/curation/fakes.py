"""A scripted policy for curation tests: solve rates the test chooses, exactly.

Prompts and completions are character codes (``encode``/``decode``). For the prompt of record
``i`` the engine answers the first ``correct[id]`` of its ``n`` samples with the reference
answer and the rest with a wrong one, so the prompt's solve rate is ``correct[id] / n``. Exit
steps are drawn from the call's seed, so records show whether seeds were reproduced.
"""

from __future__ import annotations

import random

import torch

from rltt.data.gsm8k import reference_answer
from rltt.data.rewards import RewardRunner
from rltt.rollout import RolloutBatch, RolloutEngine, RolloutStats, SamplingParams, Schedule

NUM_LOOPS = 4


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids) -> str:
    return "".join(chr(i) for i in ids)


def runner() -> RewardRunner:
    """gsm8k.strict (decides solved) + 0.5 × gsm8k.flexible: a correct sample's reward is 1.5."""
    return RewardRunner.from_specs([("rewards/gsm8k.py:strict", 1.0), ("rewards/gsm8k.py:flexible", 0.5)])


def records(n: int, prefix: str = "q") -> list[dict]:
    """``n`` GSM8K records; record i's answer is ``i + 10``."""
    return [{"id": f"{prefix}{i}", "question": f"What is {i} plus 10?",
             "answer": f"{i} + 10 = {i + 10}\n#### {i + 10}"} for i in range(n)]


class ScriptedEngine(RolloutEngine):
    """Answers ``correct[id]`` of a prompt's samples right; logs every call's (prompt ids, seeds)."""

    def __init__(self, records: list[dict], correct: dict[str, int], fail_after: int | None = None):
        self.by_question = {r["question"]: r for r in records}
        self.correct = correct
        self.fail_after = fail_after  # raise KeyboardInterrupt on this call (a kill mid-run)
        self.calls: list[tuple[list[str], int]] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt("killed")
        rows, exit_rows, ids = [], [], []
        seeds = params.prompt_seeds if params.prompt_seeds is not None else [params.seed] * len(prompts)
        for prompt, seed in zip(prompts, seeds):
            question = decode(prompt).removeprefix("Question: ").removesuffix("\nAnswer:")  # default template
            record = self.by_question[question]
            ids.append(record["id"])
            answer = reference_answer(record["answer"])
            rng = random.Random(seed)
            for j in range(params.n):
                good = j < self.correct[record["id"]]
                completion = encode(f" so #### {answer if good else -1}")
                rows.append(completion)
                exit_rows.append([rng.randint(1, NUM_LOOPS) for _ in completion])
        self.calls.append((ids, list(seeds)))
        return _batch(prompts, params, rows, exit_rows)

    def load_weights(self, version, tensors) -> None:  # the scripted policy has no weights
        self.weights_version = version


def _batch(prompts, params, rows, exit_rows) -> RolloutBatch:
    R, width = len(rows), max(len(r) for r in rows)
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.zeros((R, width), dtype=torch.long)
    exits = torch.zeros((R, width), dtype=torch.long)
    for r, (row, steps) in enumerate(zip(rows, exit_rows)):
        ids[r, : len(row)] = torch.tensor(row)
        exits[r, : len(row)] = torch.tensor(steps)
    index = [i for i in range(len(prompts)) for _ in range(params.n)]
    return RolloutBatch(
        prompts=prompts, prompt_index=torch.tensor(index),
        prompt_lengths=torch.tensor([len(prompts[i]) for i in index]),
        completion_ids=ids, completion_lengths=lengths,
        completion_mask=torch.arange(width)[None, :] < lengths[:, None], exit_steps=exits,
        logprobs=torch.zeros((R, width)), tempered_logprobs=torch.zeros((R, width)),
        gate_probs=torch.full((NUM_LOOPS, R, width), float("nan")), finish_reasons=["stop"] * R,
        schedule=Schedule(params.schedule), params=params, stats=RolloutStats(), num_loops=NUM_LOOPS,
        dtype=torch.float32)
