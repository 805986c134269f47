"""Length shaping: the soft overlong penalty popularised by DAPO, as a reward term.

``soft_overlong`` is 0 for completions up to ``max_tokens - window`` sampled tokens, falls
linearly to -1 at ``max_tokens`` and stays -1 beyond (a row given a forced answer by the thinking
budget may sample more than ``max_tokens``). ``window`` is a fifth of ``max_tokens`` — DAPO's
4096-token window before a 20480-token cap; use `make_soft_overlong` in a reward file of your own
for another window. Forced tokens do not count: they are not the policy's. The rollout passes
``completion_tokens`` and ``max_tokens`` to every reward function.
"""

from __future__ import annotations

from rltt.data.reasoning import soft_overlong_penalty

WINDOW_FRACTION = 0.2


def make_soft_overlong(window_fraction: float = WINDOW_FRACTION):
    """A soft overlong reward with a window of ``window_fraction`` of the cap."""

    def soft_overlong(completion: str, answer: str | None = None, *, completion_tokens: int, max_tokens: int,
                      **kw) -> float:
        window = max(1, min(max_tokens, round(window_fraction * max_tokens)))
        return soft_overlong_penalty(int(completion_tokens), int(max_tokens), window)

    return soft_overlong


soft_overlong = make_soft_overlong()
