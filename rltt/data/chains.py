"""Depth-hungry synthetic problems: multi-hop variable lookups, answered without worked steps.

A problem binds a few variables to numbers and others to variables, in shuffled order, and asks
for one whose value is ``hops`` lookups away; the other chains (``distractors``) have the same
length and other roots, so the answer cannot be read off the one number in sight::

    Let q = 5. Let m = b. Let k = q. Let b = x. Let x = 7. What is m?

    #### 7

The solution is the answer alone (GSM8K's ``#### N``), so every hop has to be resolved inside
the model's forward pass for the one answer token — per token depth, which a looped model adds by
looping and a dense twin of the same block cannot. ``hops`` (or the range ``min_hops..hops``) is
the difficulty knob; 0 hops asks for a variable bound to a number (one lookup, ``Let q = 5. …
What is q?``): the step every deeper chain repeats, which a curriculum (``chains-easy``: 0–3
hops mixed) lets a small model learn first. ``show_work`` writes the chain out (``m = b = x =
7``) as the control where the sequence, not the depth, carries the computation.

Problem ``i`` of seed ``s`` depends only on ``(s, i)`` and the difficulty, like the arithmetic
problems of `rltt.data.synthetic`, whose presets (``chains-2`` …) and stream functions serve both.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from rltt.errors import RlttError

VARIABLES = string.ascii_lowercase


@dataclass(frozen=True)
class ChainDifficulty:
    """Chains of ``min_hops..hops`` lookups (``min_hops`` defaults to ``hops``), ``distractors``
    other chains of the same length, roots in ``1..max_value``."""

    hops: int = 3
    min_hops: int | None = None
    distractors: int = 2
    max_value: int = 9
    show_work: bool = False
    task: str = "chains"  # tells a mapping's difficulty apart from the arithmetic one's

    def __post_init__(self) -> None:
        if self.task != "chains":
            raise RlttError(f"chain difficulty: task must be 'chains', got {self.task!r}")
        if self.hops < 0:
            raise RlttError(f"chain difficulty: hops must be >= 0, got {self.hops}")
        if self.min_hops is not None and not 0 <= self.min_hops <= self.hops:
            raise RlttError(f"chain difficulty: min_hops must be in 0..hops={self.hops}, got {self.min_hops}")
        if self.distractors < 0:
            raise RlttError(f"chain difficulty: distractors must be >= 0, got {self.distractors}")
        if self.max_value < self.distractors + 1:
            raise RlttError(f"chain difficulty: max_value={self.max_value} leaves no distinct root for each of "
                            f"{self.distractors + 1} chains")
        if (self.hops + 1) * (self.distractors + 1) > len(VARIABLES):
            raise RlttError(f"chain difficulty: (hops + 1) x (distractors + 1) = "
                            f"{(self.hops + 1) * (self.distractors + 1)} variables exceed the {len(VARIABLES)} letters")

    @property
    def hop_range(self) -> tuple[int, int]:
        return (self.hops if self.min_hops is None else self.min_hops, self.hops)

    def problem(self, index: int, seed: int = 0) -> "ChainProblem":
        """Problem number ``index`` of the stream for ``seed``."""
        rng = random.Random(f"rltt-chains:{seed}:{index}")
        hops = rng.randint(*self.hop_range)
        chains = self.distractors + 1
        names = rng.sample(VARIABLES, (hops + 1) * chains)
        roots = rng.sample(range(1, self.max_value + 1), chains)
        statements, asked = [], []
        for c in range(chains):
            chain = names[c * (hops + 1):(c + 1) * (hops + 1)]  # chain[0] = root, chain[-1] = hops away
            statements.append(f"Let {chain[0]} = {roots[c]}.")
            statements += [f"Let {chain[j]} = {chain[j - 1]}." for j in range(1, hops + 1)]
            asked.append(chain)
        rng.shuffle(statements)
        target = asked[0]
        question = " ".join(statements) + f" What is {target[-1]}?"
        work = " = ".join(reversed(target)) + f" = {roots[0]}\n" if self.show_work else ""
        return ChainProblem(id=f"chains-{seed}-{index}", hops=hops, question=question,
                            answer=f"{work}#### {roots[0]}", result=roots[0])


@dataclass(frozen=True)
class ChainProblem:
    """A generated lookup problem: its text, answer and hop count."""

    id: str
    hops: int
    question: str
    answer: str  # "#### N" (after the written-out chain with show_work)
    result: int

    def to_record(self) -> dict:
        """The GSM8K-style record ``{"id", "question", "answer"}`` (and ``hops``)."""
        return {"id": self.id, "question": self.question, "answer": self.answer, "hops": self.hops}


def chain_presets(max_hops: int = 6) -> dict[str, ChainDifficulty]:
    """``chains-H`` for H = 0..max_hops (two distractor chains, roots 1–9), ``chains`` (1–4 hops
    mixed) and ``chains-easy`` (0–3 mixed: the direct lookup beside the chains built from it)."""
    presets = {f"chains-{h}": ChainDifficulty(hops=h) for h in range(0, max_hops + 1)}
    presets["chains"] = ChainDifficulty(hops=4, min_hops=1)
    presets["chains-easy"] = ChainDifficulty(hops=3, min_hops=0)
    return presets
