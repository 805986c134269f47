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
    """One prompt: ``id``, the rendered ``prompt`` text, its token ids and the reference ``answer``;
    ``index``: its position in the `PromptStream` that handed it out (-1: not from a stream)."""

    id: str
    prompt: str
    prompt_ids: list[int]
    answer: str
    index: int = -1


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


class PromptLimit:
    """``data.max_prompt_tokens`` (the prompt length a run's memory plan budgets for): a longer
    prompt is a one-line error naming the key, the source and the record — or, with
    ``data.drop_long_prompts``, left out and counted in ``dropped``."""

    KEY = "data.max_prompt_tokens"

    def __init__(self, max_tokens: int | None = None, drop: bool = False, source: str = ""):
        self.max_tokens, self.drop, self.source = max_tokens, drop, source
        self.dropped = 0

    def keep(self, task: Task, index: int) -> bool:
        """Whether ``task`` (record ``index`` of the source) fits; raises when it does not and
        dropping is off."""
        if self.max_tokens is None or len(task.prompt_ids) <= self.max_tokens:
            return True
        if not self.drop:
            raise RlttError(f"{self.KEY}: the prompt of record {task.id!r} (index {index}) of {self.source} has "
                            f"{len(task.prompt_ids)} tokens > {self.max_tokens}; raise {self.KEY} or set "
                            f"data.drop_long_prompts=true")
        self.dropped += 1
        return False


class PromptStream:
    """Prompt batches in a deterministic, resumable order (shuffled per epoch by ``seed``).

    `limit_prompts` applies ``data.max_prompt_tokens`` (a `PromptLimit`): a file source is checked
    (or filtered) in full before any step, a synthetic one as its prompts are drawn (a dropped
    one is skipped, so the stream stays a function of its position)."""

    def __init__(self, source: str, encode, template, split: str = "train", limit: int | None = None,
                 seed: int = 0):
        self.source, self.encode, self.template, self.seed = source, encode, template, seed
        self.prompt_limit = PromptLimit()
        self.records = load_records(source, split, limit, seed)
        self.preset = source.partition(":")[2] or "quickstart"
        self.position = 0  # prompts handed out (or, synthetic, drawn) so far

    def limit_prompts(self, prompt_limit: PromptLimit) -> None:
        """Apply ``data.max_prompt_tokens`` from now on: a file source is checked (or filtered)
        in full at once, a synthetic one as its prompts are drawn."""
        self.prompt_limit = prompt_limit
        if self.records is not None and prompt_limit.max_tokens is not None:
            self.records = [r for i, r in enumerate(self.records)
                            if prompt_limit.keep(make_task(r, self.encode, self.template), i)]
            if not self.records:
                raise RlttError(f"{PromptLimit.KEY}: every prompt of {self.source} is longer than "
                                f"{prompt_limit.max_tokens} tokens")

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
        tasks = []
        while len(tasks) < n:
            task = make_task(self._record(self.position), self.encode, self.template)
            task.index = self.position
            if self.records is not None or self.prompt_limit.keep(task, self.position):  # files: checked up front
                tasks.append(task)
            self.position += 1
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
