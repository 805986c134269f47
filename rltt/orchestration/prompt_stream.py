"""Task prompts for RL: records from synthetic, GSM8K-format files or the hub, in a resumable order."""

from __future__ import annotations

import random
from dataclasses import dataclass

from rltt.data import synthetic
from rltt.data.gsm8k import format_prompt, load_gsm8k
from rltt.errors import RlttError

HELD_OUT_SEED_OFFSET = 1_000_003  # synthetic eval problems come from another seed


@dataclass
class Task:
    """One prompt: ``id``, the rendered ``prompt`` text, its token ids and the reference ``answer``."""

    id: str
    prompt: str
    prompt_ids: list[int]
    answer: str


def load_records(source: str, split: str = "train", limit: int | None = None, seed: int = 0,
                 count: int | None = None) -> list[dict] | None:
    """GSM8K-style records of ``source``; None for an endless synthetic stream (``count`` None)."""
    if source.startswith("synthetic"):
        _, _, preset = source.partition(":")
        if count is None:
            return None
        return synthetic.generate(count, preset or "quickstart", seed=seed)
    records = load_gsm8k(source, split=split, limit=limit)
    if not records:
        raise RlttError(f"data source {source!r} (split {split!r}) has no records")
    return records


def make_task(record: dict, encode, template) -> Task:
    """``template``: a ``{question}`` template or a renderer (`rltt.data.prompts.prompt_renderer`)."""
    question = record["question"]
    prompt = template(question) if callable(template) else format_prompt(question, template)
    return Task(str(record.get("id", "")), prompt, list(encode(prompt)), record["answer"])


def check_prompt_lengths(records, encode, template, limit: int, key: str, what: str) -> None:
    """One-line error naming the file and line (or record id) of the first prompt whose tokens
    plus the completion budget exceed ``limit`` positions (``what`` says where the limit comes from)."""
    for record in records:
        n = len(make_task(record, encode, template).prompt_ids)
        if n > limit:
            raise RlttError(f"{key}: the prompt of record {record.get('id', '?')!r} has "
                            f"{n} tokens; {what}")


class PromptStream:
    """Prompt batches in a deterministic, resumable order (shuffled per epoch by ``seed``)."""

    def __init__(self, source: str, encode, template, split: str = "train", limit: int | None = None,
                 seed: int = 0):
        self.source, self.encode, self.template, self.seed = source, encode, template, seed
        self.records = load_records(source, split, limit, seed)
        self.preset = source.partition(":")[2] or "quickstart"
        self.position = 0  # prompts handed out so far

    def _record(self, index: int) -> dict:
        if self.records is None:
            return synthetic.generate_problem(index, self.preset, self.seed).to_record()
        epoch, offset = divmod(index, len(self.records))
        order = list(range(len(self.records)))
        random.Random(self.seed * 1_000_033 + epoch).shuffle(order)
        return self.records[order[offset]]

    def check_lengths(self, limit: int, key: str, what: str) -> None:
        """`check_prompt_lengths` over every record of a file source (synthetic prompts are short)."""
        if self.records is not None:
            check_prompt_lengths(self.records, self.encode, self.template, limit, key, what)

    def next(self, n: int) -> list[Task]:
        tasks = [make_task(self._record(self.position + i), self.encode, self.template) for i in range(n)]
        self.position += n
        return tasks

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def eval_tasks(source: str | None, train_source: str, encode, template, split: str, size: int,
               seed: int) -> list[Task]:
    """Held-out tasks: ``source``'s split, or synthetic problems from a disjoint seed."""
    source = source or train_source
    if source.startswith("synthetic"):
        records = load_records(source, count=size, seed=seed + HELD_OUT_SEED_OFFSET)
    else:
        records = load_records(source, split, limit=size)
    return [make_task(r, encode, template) for r in records[:size]]
