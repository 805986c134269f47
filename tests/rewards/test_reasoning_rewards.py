"""Rewards for reasoning output: the answer is read after the thinking, never inside it."""

import pytest

from rltt.data.reasoning import (answer_part, final_answer, soft_overlong_penalty, split_thinking, well_formed)
from rltt.data.rewards import RewardRunner, RewardSample
from rltt.errors import RlttError
from rewards.format import thinking_format
from rewards.gsm8k import flexible, strict
from rewards.length import make_soft_overlong, soft_overlong
from rewards.math import math_verify

THINK = "<think>\nFirst 3 + 4 = 8? No, #### 8 would be wrong; \\boxed{8} too. It is 7.\n</think>\n\n"


def test_split_thinking():
    s = split_thinking(THINK + "The answer is \\boxed{7}.")
    assert s.closed and s.answer == "\n\nThe answer is \\boxed{7}." and "#### 8" in s.thinking
    assert not s.thinking.startswith("<think>")
    assert split_thinking("<think> still going 12").answer == ""  # unclosed: no answer
    assert split_thinking("no markers #### 4").answer == "no markers #### 4"  # non-reasoning output
    assert answer_part("already opened by the template 9</think>#### 5") == "#### 5"


@pytest.mark.parametrize("text,value", [
    ("so \\boxed{1,200}.", "1200"), ("#### $5", "5"), ("\\boxed{12} then #### 13", "13"),
    ("#### 13 then \\boxed{\\$12}", "12"), ("\\boxed{\\text{about }7}", "7"), ("nothing here 4", None),
    ("\\boxed{x+1}", None), ("\\boxed{-3.5}", "-3.5"),
])
def test_final_answer_reads_boxed_and_hashes(text, value):
    assert final_answer(text) == value


def test_gsm8k_rewards_ignore_numbers_inside_the_thinking():
    assert strict(THINK + "The answer is \\boxed{7}.", "#### 7") == 1.0
    assert strict(THINK + "#### 7", "7") == 1.0
    assert strict(THINK + "The answer is \\boxed{7}.", "#### 8") == 0.0  # the 8s are inside the thinking
    assert strict("<think>#### 7 \\boxed{7}", "7") == 0.0  # never closed: no answer
    assert flexible(THINK + "So 7 apples.", "7") == 1.0
    assert flexible(THINK + "So seven apples.", "7") == 0.0  # the thinking's "7" does not count
    assert strict("Work.\n#### 42", "#### 42") == 1.0  # plain completions as before


def test_math_verify_reads_the_answer_after_the_thinking():
    pytest.importorskip("math_verify")
    assert math_verify(THINK + "Hence $\\boxed{\\frac{14}{2}}$.", "#### 7") == 1.0
    assert math_verify(THINK + "Hence $\\boxed{\\frac{14}{2}}$.", "#### 8") == 0.0
    assert math_verify(THINK + "#### 7", "#### 7") == 1.0
    assert math_verify("<think>\\boxed{7}", "#### 7") == 0.0


def test_thinking_format_reward():
    assert well_formed(THINK + "It is \\boxed{7}.")
    assert thinking_format("reasoning</think>\n#### 7") == 1.0  # opening tag written by the template
    assert thinking_format(THINK + "no final answer") == 0.0
    assert thinking_format(THINK + "\\boxed{7} or \\boxed{8}") == 0.0  # two answers
    assert thinking_format("<think>unclosed \\boxed{7}") == 0.0
    assert thinking_format(THINK + "\\boxed{7}</think>\\boxed{7}") == 0.0  # two closes
    assert thinking_format("\\boxed{7}") == 0.0  # no thinking at all


def test_soft_overlong_penalty():
    assert soft_overlong_penalty(80, 100, 20) == 0.0
    assert soft_overlong_penalty(90, 100, 20) == -0.5
    assert soft_overlong_penalty(100, 100, 20) == -1.0
    assert soft_overlong_penalty(130, 100, 20) == -1.0
    with pytest.raises(RlttError, match="window"):
        soft_overlong_penalty(1, 10, 0)
    assert soft_overlong("x", "1", completion_tokens=95, max_tokens=100) == -0.75
    assert make_soft_overlong(0.5)("x", "1", completion_tokens=75, max_tokens=100) == -0.5


def test_overlong_term_gets_the_token_counts_through_the_runner():
    runner = RewardRunner.from_specs([("rewards/gsm8k.py:strict", 1.0), ("rewards/length.py:soft_overlong", 0.5)])
    result = runner.score([RewardSample(THINK + "\\boxed{7}", "7", "a", {"completion_tokens": 90, "max_tokens": 100}),
                           RewardSample("#### 7", "7", "b", {"completion_tokens": 10, "max_tokens": 100})])
    assert result.scores["length.soft_overlong"] == [-0.5, 0.0]
    assert result.total == [0.75, 1.0]
    assert not result.errors
