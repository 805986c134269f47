"""Math reward through the ``math-verify`` package (``pip install 'rltt[math]'``).

Both sides go through ``math_verify.parse`` (LaTeX such as ``\\boxed{\\frac{1}{2}}`` or plain
expressions) and ``math_verify.verify`` decides equivalence. A GSM8K reference solution is
reduced to its ``#### N`` number first. Only the answer after a reasoning model's thinking
(after the last ``</think>``) is parsed; ``#### N`` there counts as ``N``.

Not a built-in fast-path reward: sympy can take unbounded time on adversarial LaTeX, so it
runs in a reward worker with the per-call timeout like user rewards.
"""

from __future__ import annotations

from rltt.data.gsm8k import extract_final_answer
from rltt.data.reasoning import answer_part
from rltt.errors import RlttError


def _math_verify_module():
    try:
        import math_verify
    except ImportError:
        raise RlttError("reward math_verify needs the 'math-verify' package (pip install 'rltt[math]')") from None
    return math_verify


def math_verify(completion: str, answer: str, **kw) -> float:
    """1.0 if ``completion``'s final answer is mathematically equivalent to ``answer``, else 0.0."""
    mv = _math_verify_module()
    reference = extract_final_answer(answer) or answer
    # a bare LaTeX answer (MATH's "2\\sqrt{2}") parses as math only between $…$; raw text parses
    # the first number alone
    delimited = "$" in reference or "\\boxed" in reference or "\\(" in reference
    gold = mv.parse(reference) if delimited else mv.parse(f"${reference}$")
    if not gold:
        gold = mv.parse(f"${reference}$") if delimited else mv.parse(reference)
    text = answer_part(completion)
    hashed = extract_final_answer(text) if "\\boxed" not in text else None
    predicted = mv.parse(f"${hashed}$" if hashed is not None else text)
    if not gold or not predicted:
        return 0.0
    return 1.0 if mv.verify(gold, predicted) else 0.0
