"""Format rewards: a GSM8K answer line (`format_reward`); closed thinking + one answer (`thinking_format`)."""

from __future__ import annotations

from rltt.data.gsm8k import has_final_answer_line
from rltt.data.reasoning import well_formed
from rltt.data.reward_fns import builtin_reward


@builtin_reward  # string parsing only: runs in the trainer's process
def format_reward(completion: str, answer: str | None = None, **kw) -> float:
    """1.0 if the completion has a line that is exactly ``#### <number>``, else 0.0.

    The answer's value is not checked (``answer`` is accepted for the common signature).
    """
    return 1.0 if has_final_answer_line(completion) else 0.0


def thinking_format(completion: str, answer: str | None = None, **kw) -> float:
    """1.0 if the completion closes its thinking once (``<think> … </think>``, the opening tag
    optional: chat templates may write it) and then gives exactly one final answer
    (``\\boxed{…}`` or ``#### …``), else 0.0."""
    return 1.0 if well_formed(completion) else 0.0
