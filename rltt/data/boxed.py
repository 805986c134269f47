"""``\\boxed{…}`` (and ``\\fbox{…}``) answers: their contents, with balanced braces.

One parser for the reasoning rewards (`rltt.data.reasoning`) and the MATH-style loaders
(`rltt.data.math_sets`, which take a solution's last boxed answer as its reference)."""

from __future__ import annotations

import re

BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def boxed_spans(text: str) -> list[tuple[int, str]]:
    """``(start, contents)`` of every closed ``\\boxed{…}`` in ``text``, in order: ``start`` is where
    its command begins; one whose braces never close is left out."""
    spans = []
    for match in BOXED.finditer(text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            spans.append((match.start(), text[match.end(): i - 1]))
    return spans


def boxed_contents(text: str) -> list[str]:
    """The contents of every closed ``\\boxed{…}`` in ``text``, in order."""
    return [content for _, content in boxed_spans(text)]


def last_boxed(text: str) -> str | None:
    """The contents of the last closed ``\\boxed{…}`` in ``text``, stripped; None when it has none."""
    spans = boxed_spans(text)
    return spans[-1][1].strip() if spans else None
