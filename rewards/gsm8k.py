"""GSM8K rewards: the final answer, ``#### N`` or ``\\boxed{N}`` (strict), or the last number (flexible).

Both read the answer after a reasoning model's thinking (after the last ``</think>``; nothing
when the thinking never closes), so numbers inside the thinking never count.

``answer`` is the reference: a GSM8K solution ending in ``#### N`` or a bare number.
Numbers compare by value: ``"$1,200"`` equals ``"1200.00"``; ``"-3"`` is negative.
"""

from __future__ import annotations

from rltt.data.gsm8k import extract_last_number, reference_answer, to_decimal
from rltt.data.reasoning import answer_part, final_answer
from rltt.data.reward_fns import builtin_reward


def _matches(predicted: str | None, answer: str) -> float:
    reference = reference_answer(answer)
    if predicted is None or reference is None:
        return 0.0
    return 1.0 if to_decimal(predicted) == to_decimal(reference) else 0.0


@builtin_reward  # string parsing only: runs in the trainer's process
def strict(completion: str, answer: str, **kw) -> float:
    """1.0 if the completion's final answer (its last ``####`` or ``\\boxed{}``) equals the reference."""
    return _matches(final_answer(answer_part(completion)), answer)


@builtin_reward
def flexible(completion: str, answer: str, **kw) -> float:
    """1.0 if the last number anywhere in the completion equals the reference, else 0.0."""
    return _matches(extract_last_number(answer_part(completion)), answer)
