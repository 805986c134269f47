"""Reasoning-model output: the thinking, the answer after it, length telemetry and shaping.

A thinking model writes ``<think> … </think>`` and then its answer. Rewards read only the
answer (`answer_part`): numbers inside the thinking never count. The final answer of an
answer part is the last ``\\boxed{…}`` or ``#### N`` in it (`final_answer`).

Token side: `thinking_budget` turns a recipe's ``rollout.thinking`` strings into the engine's
`ThinkingBudget` (token ids); `length_sums` / `length_metrics` give the ``length/*`` telemetry
of a `RolloutBatch`; `soft_overlong_penalty` is the DAPO-style soft overlong penalty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rltt.data.boxed import boxed_contents, boxed_spans
from rltt.data.gsm8k import extract_final_answer, normalize_number
from rltt.errors import RlttError

OPEN, CLOSE = "<think>", "</think>"

_HASHES = re.compile(r"####")


@dataclass
class ThinkingSplit:
    """``thinking`` (without the markers), ``answer`` (after the last close marker), ``closed``."""

    thinking: str
    answer: str
    closed: bool


def split_thinking(text: str, open: str = OPEN, close: str = CLOSE) -> ThinkingSplit:
    """Split a completion at its last ``close`` marker.

    - closed: the thinking is everything before the last ``close`` (a leading ``open`` dropped),
      the answer everything after it;
    - opened but never closed: all thinking, no answer;
    - neither marker (a non-reasoning completion): no thinking, all answer."""
    head, sep, tail = text.rpartition(close)
    if sep:
        start = head.find(open)
        thinking = head[start + len(open):] if start >= 0 else head
        return ThinkingSplit(thinking, tail, True)
    if open in text:
        return ThinkingSplit(text.split(open, 1)[1], "", False)
    return ThinkingSplit("", text, False)


def answer_part(text: str, open: str = OPEN, close: str = CLOSE) -> str:
    """The text a reward reads: after the thinking (see `split_thinking`)."""
    return split_thinking(text, open, close).answer


def final_answer_text(text: str) -> str | None:
    """The raw final answer of ``text``: the content of its last ``\\boxed{…}`` or what follows
    its last ``####`` on that line, whichever comes later; None when it has neither."""
    boxed = boxed_spans(text)
    hashes = [m for m in _HASHES.finditer(text)]
    last_box = boxed[-1] if boxed else None
    last_hash = hashes[-1] if hashes else None
    if last_hash is not None and (last_box is None or last_hash.start() > last_box[0]):
        return text[last_hash.end():].split("\n", 1)[0].strip()
    return None if last_box is None else last_box[1].strip()


def final_answer(text: str) -> str | None:
    """The final answer of ``text`` as a normalized number (``\\boxed{1,200}`` -> ``"1200"``,
    ``#### $5`` -> ``"5"``), or None when there is none or it is not a number."""
    raw = final_answer_text(text)
    if raw is None:
        return None
    hashed = extract_final_answer("#### " + raw)
    if hashed is not None:
        return hashed
    cleaned = re.sub(r"\\(?:text|mathrm)\{[^}]*\}|\\[,!;: ]|\\\$|\$|\\%|%", "", raw).strip()
    return normalize_number(cleaned)


def count_final_answers(text: str) -> int:
    """How many final answers ``text`` gives: ``\\boxed{…}`` plus ``####`` markers."""
    return len(boxed_contents(text)) + len(_HASHES.findall(text))


def well_formed(text: str, open: str = OPEN, close: str = CLOSE) -> bool:
    """Closed thinking and one answer: exactly one ``close`` marker, at most one ``open`` (before
    it), and exactly one final answer (one ``\\boxed{…}`` or one ``####``), after the thinking."""
    if text.count(close) != 1 or text.count(open) > 1:
        return False
    if open in text and text.index(open) > text.index(close):
        return False
    answer = split_thinking(text, open, close).answer
    return count_final_answers(answer) == 1 and final_answer_text(answer) not in (None, "")


def soft_overlong_penalty(length: int, max_length: int, window: int) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_length - window`` tokens, then falling
    linearly to -1 at ``max_length``, and -1 beyond."""
    if window < 1 or max_length < window:
        raise RlttError(f"soft overlong penalty: need 1 <= window <= max_length, got window={window}, "
                        f"max_length={max_length}")
    free = max_length - window
    if length <= free:
        return 0.0
    if length <= max_length:
        return (free - length) / window
    return -1.0


# -- token side ---------------------------------------------------------------------------------


def thinking_budget(section, tokenizer):
    """The engine's `ThinkingBudget` of a recipe's ``rollout.thinking`` section (strings tokenized
    without special tokens added), or None when ``budget`` is 0."""
    from rltt.rollout.params import ThinkingBudget

    if not section.budget:
        return None
    encode = lambda text: list(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    close, interruption = encode(section.close), encode(section.interruption)
    if not close:
        raise RlttError(f"rollout.thinking.close: {section.close!r} encodes to no tokens")
    if not interruption:
        raise RlttError(f"rollout.thinking.interruption: {section.interruption!r} encodes to no tokens")
    return ThinkingBudget(section.budget, close, interruption, section.answer_budget)


def _find(seq: list[int], sub: list[int]) -> int:
    """Index just past the first occurrence of ``sub`` in ``seq``, or -1."""
    k = len(sub)
    for i in range(len(seq) - k + 1):
        if seq[i: i + k] == sub:
            return i + k
    return -1


def length_sums(rollout, close: list[int]) -> dict[str, float]:
    """Sums over a `RolloutBatch`'s rows for the ``length/*`` thinking metrics (add them across
    ranks, then `length_metrics`): ``rows``, ``forced`` (rows with forced tokens), ``unclosed``
    (no ``close`` token ids in the completion), ``think`` (tokens through the first close, the
    whole completion when unclosed) and ``answer`` (tokens after it)."""
    forced = rollout.forced_mask.any(dim=1)
    sums = {"rows": float(rollout.num_rows), "forced": float(forced.sum()), "unclosed": 0.0, "think": 0.0,
            "answer": 0.0}
    for r in range(rollout.num_rows):
        completion = rollout.completion(r)
        end = _find(completion, close)
        if end < 0:
            sums["unclosed"] += 1
            end = len(completion)
        sums["think"] += end
        sums["answer"] += len(completion) - end
    return sums


def length_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``length/forced_frac``, ``length/think_mean``, ``length/answer_mean``, ``length/unclosed_frac``
    from (reduced) `length_sums`."""
    from rltt.telemetry import schema as m

    rows = max(float(sums["rows"]), 1.0)
    return {m.LENGTH_FORCED_FRAC: float(sums["forced"]) / rows, m.LENGTH_THINK_MEAN: float(sums["think"]) / rows,
            m.LENGTH_ANSWER_MEAN: float(sums["answer"]) / rows, m.LENGTH_UNCLOSED_FRAC: float(sums["unclosed"]) / rows}
