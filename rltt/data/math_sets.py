"""MATH-style problem/answer sets: records of the MATH / MATH-500 and AIME layouts.

A data source in one of these layouts (a JSONL or Parquet file, a directory with ``{split}.jsonl``,
or a hub id) loads through the same loader as GSM8K (`rltt.data.gsm8k.load_gsm8k`): a record
without a ``question`` field is matched against `LAYOUTS`, in order, and becomes
``{"id", "question", "answer", "layout", ...}`` with the layout's metadata fields kept
(``subject``, ``level``, ``type``, ``year``). Answers are LaTeX or integers as the sets write them
(``\\frac{14}{3}``, ``204``); score them with ``rewards/math.py:math_verify``, which compares a
completion's ``\\boxed{}`` answer to the reference by mathematical equivalence.

Layouts (field names as the public sets spell them):

- ``math500`` — ``problem``, ``solution``, ``answer``, ``subject``, ``level``, ``unique_id``
  (MATH-500; the id is ``unique_id``, e.g. ``test/precalculus/807.json``);
- ``aime`` — ``problem`` / ``Problem`` / ``Question``, ``answer`` / ``Answer``, an optional id
  ``id`` / ``ID`` / ``problem_id``, optional ``solution`` / ``Solution``, ``year`` / ``Year``;
- ``math`` — ``problem``, ``solution`` with the answer in its last ``\\boxed{}``, ``level``,
  ``type`` (the MATH training set).

A hub set loads its default config unless `rltt.data.gsm8k.HUB_CONFIGS` names another
(``openai/gsm8k``: ``main``); MATH-500 and the AIME sets need none.
"""

from __future__ import annotations

from dataclasses import dataclass

from rltt.data.boxed import last_boxed
from rltt.errors import RlttError


@dataclass(frozen=True)
class Layout:
    """Where a layout keeps the problem, the answer and the id (the first spelling present wins).
    ``answer`` empty: the answer is the last ``\\boxed{}`` of the ``solution`` field."""

    name: str
    question: tuple[str, ...]
    answer: tuple[str, ...]
    ids: tuple[str, ...] = ()
    solution: tuple[str, ...] = ("solution", "Solution")
    kept: tuple[str, ...] = ()
    requires_id: bool = False

    def matches(self, record: dict) -> bool:
        has = lambda names: any(record.get(n) is not None for n in names)  # noqa: E731
        if not has(self.question) or (self.requires_id and not has(self.ids)):
            return False
        return has(self.answer) if self.answer else has(self.solution)


LAYOUTS: tuple[Layout, ...] = (
    Layout("math500", question=("problem",), answer=("answer",), ids=("unique_id",),
           kept=("subject", "level"), requires_id=True),
    Layout("aime", question=("problem", "Problem", "Question"), answer=("answer", "Answer"),
           ids=("id", "ID", "Id", "problem_id", "unique_id"), kept=("year", "Year", "subject", "level")),
    Layout("math", question=("problem", "Problem"), answer=(), ids=("id", "ID", "unique_id"),
           kept=("level", "type", "subject")),
)
"""The MATH-style layouts, tried in order on a record that has no ``question`` field."""

QUESTION_FIELDS = frozenset(f for layout in LAYOUTS for f in layout.question)


def _first(record: dict, names: tuple[str, ...]):
    return next((record[n] for n in names if record.get(n) is not None), None)


def _text(value: object, field: str, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RlttError(f"{where}: field '{field}' must be text or a number, got {type(value).__name__}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


def layout_of(record: dict) -> Layout | None:
    """The first layout of `LAYOUTS` that ``record`` fits, or None."""
    return next((layout for layout in LAYOUTS if layout.matches(record)), None)


def to_record(record: dict, where: str) -> dict | None:
    """``record`` of a MATH-style layout as ``{"id"?, "question", "answer", "layout", kept fields}``;
    None when it has no problem field of any layout (not a MATH-style record)."""
    layout = layout_of(record)
    if layout is None:
        if any(record.get(f) is not None for f in QUESTION_FIELDS):
            raise RlttError(f"{where}: a MATH-style record (field 'problem') needs an 'answer' field or a "
                            f"'solution' with a \\boxed{{}} answer")
        return None
    question = _text(_first(record, layout.question), "problem", where)
    if layout.answer:
        answer = _text(_first(record, layout.answer), "answer", where)
    else:
        answer = last_boxed(_text(_first(record, layout.solution), "solution", where))
        if answer is None:
            raise RlttError(f"{where}: the solution has no \\boxed{{}} answer (and the record no 'answer' field)")
    if not question or not answer:
        raise RlttError(f"{where}: empty {'problem' if not question else 'answer'}")
    out = {"question": question, "answer": answer, "layout": layout.name}
    record_id = _first(record, layout.ids)
    if record_id is not None:
        out["id"] = _text(record_id, "id", where)
    for name in layout.kept:
        if record.get(name) is not None:
            out[name.lower()] = record[name]
    return out
