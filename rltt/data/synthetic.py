"""Synthetic GSM8K-format word problems with a difficulty knob.

A problem is a person holding some number of items, then a chain of operations on that
count (buying more, giving some away, multiplying, splitting into equal groups), then the
question "How many ITEMS does NAME have now?". The worked solution uses GSM8K's format, one
line per operation with a calculator annotation, ending in ``#### N``::

    Ann has 7 apples. She buys 5 more apples. She gives 3 apples to Ben.
    How many apples does Ann have now?

    Ann has 7+5 = <<7+5=12>>12 apples.
    Ann has 12-3 = <<12-3=9>>9 apples.
    #### 9

The vocabulary is small and the sentences are regular so that a tiny model can learn the
language quickly and spend its capacity on the arithmetic. Difficulty comes from the number
of operations (``num_ops``, or a range ``min_ops..num_ops``) and the size of the numbers
(``max_value`` bounds every number that appears: start, operands, intermediate results).
All numbers are positive integers and every division is exact.

Problem ``i`` of seed ``s`` depends only on ``(s, i)`` and the difficulty, so any slice of the
stream can be regenerated without generating what comes before it.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Mapping

from rltt.data.chains import ChainDifficulty, ChainProblem, chain_presets
from rltt.errors import RlttError

OPS = ("add", "sub", "mul", "div")

# (name, subject pronoun). Kept short and few: a tiny model learns them in minutes.
PEOPLE = (
    ("Ann", "She"), ("Ben", "He"), ("Cara", "She"), ("Dan", "He"),
    ("Eva", "She"), ("Finn", "He"), ("Gia", "She"), ("Hugo", "He"),
)
ITEMS = ("apples", "pens", "books", "cookies", "marbles", "stickers", "cards", "eggs")

# One sentence pattern per verb; {p} pronoun, {n} operand, {i} items, {o} other person.
QUESTION_PATTERNS = {
    "add": ("{p} buys {n} more {i}.", "{p} finds {n} more {i}.", "{o} gives {p_obj} {n} more {i}."),
    "sub": ("{p} gives {n} {i} to {o}.", "{p} sells {n} {i}.", "{p} loses {n} {i}."),
    "mul": ("{p} then has {n} times as many {i} as before.",),
    "div": ("{p} splits the {i} into {n} equal groups and keeps one group.",),
}
SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
OBJECT_PRONOUN = {"She": "her", "He": "him"}


@dataclass(frozen=True)
class Difficulty:
    """How hard the generated problems are.

    ``num_ops`` is the (maximum) number of operations; each problem draws its count uniformly
    from ``min_ops..num_ops`` (``min_ops`` defaults to ``num_ops``). ``max_value`` bounds
    every number in the problem and its solution. ``ops`` restricts the operation kinds.
    ``calculator`` writes GSM8K's ``<<a+b=c>>`` annotations in the solution steps.
    """

    num_ops: int = 2
    max_value: int = 20
    min_ops: int | None = None
    ops: tuple[str, ...] = OPS
    calculator: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        if self.num_ops < 1:
            raise RlttError(f"synthetic difficulty: num_ops must be >= 1, got {self.num_ops}")
        if self.min_ops is not None and not 1 <= self.min_ops <= self.num_ops:
            raise RlttError(
                f"synthetic difficulty: min_ops must be in 1..num_ops={self.num_ops}, got {self.min_ops}"
            )
        if self.max_value < 4:
            raise RlttError(f"synthetic difficulty: max_value must be >= 4, got {self.max_value}")
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise RlttError(f"synthetic difficulty: ops must be a non-empty subset of {OPS}, got {self.ops}")
        if not {"add", "sub"} <= set(self.ops):
            # without both a chain can dead-end (1 cannot shrink, max_value cannot grow).
            raise RlttError("synthetic difficulty: ops must include 'add' and 'sub'")

    def problem(self, index: int, seed: int = 0) -> "SyntheticProblem":
        """Problem number ``index`` of the stream for ``seed``."""
        return arithmetic_problem(index, self, seed)

    @property
    def op_range(self) -> tuple[int, int]:
        """Inclusive (min, max) number of operations per problem."""
        return (self.num_ops if self.min_ops is None else self.min_ops, self.num_ops)


DIFFICULTY_PRESETS: dict[str, Difficulty] = {
    # one addition or subtraction of single-digit numbers
    "trivial": Difficulty(num_ops=1, max_value=9, ops=("add", "sub")),
    # one operation of any kind, single-digit numbers
    "easy": Difficulty(num_ops=1, max_value=9),
    # what a few-M-parameter CPU model should solve sometimes (tuned by the quickstart)
    "quickstart": Difficulty(num_ops=2, min_ops=1, max_value=20),
    "medium": Difficulty(num_ops=3, min_ops=2, max_value=50),
    "hard": Difficulty(num_ops=4, min_ops=3, max_value=100),
    "expert": Difficulty(num_ops=6, min_ops=4, max_value=1000),
}


DIFFICULTY_PRESETS.update(chain_presets())  # the depth-hungry lookups of rltt.data.chains

#: a mapping's ``task`` → the difficulty class it builds (default: the arithmetic problems)
TASKS = {"arithmetic": Difficulty, "chains": ChainDifficulty}


def resolve_difficulty(difficulty: str | Difficulty | ChainDifficulty | Mapping) -> Difficulty | ChainDifficulty:
    """A difficulty from a preset name, a difficulty, or a mapping of its fields (``task:
    chains`` for `rltt.data.chains.ChainDifficulty`)."""
    if isinstance(difficulty, tuple(TASKS.values())):
        return difficulty
    if isinstance(difficulty, str):
        try:
            return DIFFICULTY_PRESETS[difficulty]
        except KeyError:
            raise RlttError(
                f"unknown synthetic difficulty '{difficulty}' (presets: {', '.join(DIFFICULTY_PRESETS)})"
            ) from None
    if isinstance(difficulty, Mapping):
        fields = dict(difficulty)
        if "preset" in fields:  # a preset with some fields overridden
            base = asdict(resolve_difficulty(fields.pop("preset")))
            fields = {**base, **fields}
        task = fields.pop("task", "arithmetic")
        if task not in TASKS:
            raise RlttError(f"synthetic difficulty: unknown task {task!r} (tasks: {', '.join(TASKS)})")
        cls = TASKS[task]
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise RlttError(f"synthetic difficulty: unknown field(s) {sorted(unknown)}")
        return cls(**fields)
    raise RlttError(f"synthetic difficulty must be a preset name or a mapping, got {type(difficulty).__name__}")


@dataclass(frozen=True)
class Step:
    """One operation: ``before OP operand = after``."""

    op: str
    operand: int
    before: int
    after: int

    @property
    def expression(self) -> str:
        return f"{self.before}{SYMBOLS[self.op]}{self.operand}"


def apply_op(op: str, value: int, operand: int) -> int:
    """The exact integer result of one operation (division must be exact)."""
    if op == "add":
        return value + operand
    if op == "sub":
        return value - operand
    if op == "mul":
        return value * operand
    if op == "div":
        if value % operand:
            raise ValueError(f"{value}/{operand} is not exact")
        return value // operand
    raise ValueError(f"unknown op {op!r}")


@dataclass(frozen=True)
class SyntheticProblem:
    """A generated problem in structured form plus its GSM8K-format text."""

    id: str
    name: str
    pronoun: str
    item: str
    other: str
    start: int
    steps: tuple[Step, ...]
    question: str
    answer: str  # worked solution ending in "#### N"

    @property
    def result(self) -> int:
        """The final count, recomputed from ``start`` and the operations."""
        value = self.start
        for step in self.steps:
            value = apply_op(step.op, value, step.operand)
        return value

    def to_record(self) -> dict:
        """The GSM8K-style record ``{"id", "question", "answer"}``."""
        return {"id": self.id, "question": self.question, "answer": self.answer}


def _candidate_operands(op: str, value: int, max_value: int) -> list[int]:
    """Operands for ``op`` that keep the result a positive integer <= max_value."""
    if op == "add":
        return list(range(1, max_value - value + 1))
    if op == "sub":
        return list(range(1, value))
    if op == "mul":
        return list(range(2, max_value // value + 1))
    if op == "div":
        return [d for d in range(2, value) if value % d == 0]
    raise ValueError(op)


def _problem_rng(seed: int, index: int) -> random.Random:
    # String seeds are hashed with SHA-512: stable across processes and Python versions.
    return random.Random(f"rltt-synthetic:{seed}:{index}")


def generate_problem(index: int, difficulty: str | Difficulty | ChainDifficulty | Mapping = "quickstart",
                     seed: int = 0) -> SyntheticProblem | ChainProblem:
    """Problem number ``index`` of the stream for ``seed`` (depends on nothing else)."""
    return resolve_difficulty(difficulty).problem(index, seed)


def arithmetic_problem(index: int, diff: Difficulty, seed: int = 0) -> SyntheticProblem:
    """The word problem number ``index`` of ``diff``'s stream for ``seed``."""
    rng = _problem_rng(seed, index)
    (name, pronoun), (other, _) = rng.sample(PEOPLE, 2)
    item = rng.choice(ITEMS)
    num_ops = rng.randint(*diff.op_range)

    value = rng.randint(2, diff.max_value)
    start = value
    steps: list[Step] = []
    for _ in range(num_ops):
        choices = [(op, c) for op in diff.ops if (c := _candidate_operands(op, value, diff.max_value))]
        # for 1 <= value <= max_value, 'add' (value < max_value) or 'sub' (value >= 2) applies;
        # both are always allowed, so choices is never empty.
        op, operands = rng.choice(choices)
        operand = rng.choice(operands)
        after = apply_op(op, value, operand)
        steps.append(Step(op, operand, value, after))
        value = after

    sentences = [f"{name} has {start} {item}."]
    for step in steps:
        pattern = rng.choice(QUESTION_PATTERNS[step.op])
        sentences.append(
            pattern.format(p=pronoun, p_obj=OBJECT_PRONOUN[pronoun], n=step.operand, i=item, o=other)
        )
    sentences.append(f"How many {item} does {name} have now?")
    question = " ".join(sentences)

    lines = []
    for step in steps:
        calc = f"<<{step.expression}={step.after}>>" if diff.calculator else ""
        lines.append(f"{name} has {step.expression} = {calc}{step.after} {item}.")
    lines.append(f"#### {value}")
    return SyntheticProblem(
        id=f"synthetic-{seed}-{index}",
        name=name,
        pronoun=pronoun,
        item=item,
        other=other,
        start=start,
        steps=tuple(steps),
        question=question,
        answer="\n".join(lines),
    )


def iter_problems(
    difficulty: str | Difficulty | Mapping = "quickstart", seed: int = 0, start: int = 0
) -> Iterator[SyntheticProblem]:
    """An endless stream of problems ``start, start+1, ...`` for ``seed``."""
    diff = resolve_difficulty(difficulty)
    index = start
    while True:
        yield generate_problem(index, diff, seed)
        index += 1


def generate(
    n: int, difficulty: str | Difficulty | Mapping = "quickstart", seed: int = 0, start: int = 0
) -> list[dict]:
    """``n`` GSM8K-style records ``{"id", "question", "answer"}``."""
    diff = resolve_difficulty(difficulty)
    return [generate_problem(i, diff, seed).to_record() for i in range(start, start + n)]


def write_jsonl(
    path: str | Path, n: int, difficulty: str | Difficulty | Mapping = "quickstart", seed: int = 0, start: int = 0
) -> Path:
    """Write ``n`` problems to ``path`` as JSONL (one GSM8K-style record a line); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in generate(n, difficulty, seed, start):
            f.write(json.dumps(record) + "\n")
    tmp.replace(path)
    return path
