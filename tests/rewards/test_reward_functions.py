"""GSM8K strict/flexible, math-verify and format rewards."""

import pytest
from hypothesis import given, strategies as st

from rewards.format import format_reward
from rewards.gsm8k import flexible, strict
from rewards.math import math_verify

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("She sold 72 in total.\n#### 72", GSM8K_ANSWER, 1.0),
        ("#### 71", GSM8K_ANSWER, 0.0),
        ("#### 1,200", "1200", 1.0),
        ("#### $1,200.00", "#### 1200", 1.0),
        ("#### $5", "5", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### -3", "3", 0.0),
        ("#### $-3", "#### -3", 1.0),
        ("#### 2.50", "2.5", 1.0),
        ("#### 0.5", "#### .5", 1.0),
        ("the answer is 72", GSM8K_ANSWER, 0.0),  # no #### line
        ("#### seventy-two", GSM8K_ANSWER, 0.0),
        ("", GSM8K_ANSWER, 0.0),
        ("#### 3\n#### 72", GSM8K_ANSWER, 1.0),  # the last #### counts
        ("#### 72", "no number in the reference", 0.0),
    ],
)
def test_strict(completion, answer, expected):
    assert strict(completion, answer) == expected


@given(st.integers(-10**9, 10**9))
def test_strict_any_integer_with_commas(n):
    assert strict(f"#### {n:,}", str(n)) == 1.0
    assert strict(f"#### {n + 1}", f"#### {n}") == 0.0


@given(st.decimals(min_value=-10**6, max_value=10**6, places=3, allow_nan=False))
def test_strict_decimals(x):
    assert strict(f"#### {x}", f"#### {x.normalize():f}") == 1.0


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("First 10, then 20, so 72.", 1.0),
        ("It is 72 and not 71", 0.0),
        ("#### 72", 1.0),
        ("total: $72.00", 1.0),
        ("no numbers", 0.0),
    ],
)
def test_flexible_last_number(completion, expected):
    assert flexible(completion, GSM8K_ANSWER) == expected


def test_extra_kwargs_ignored():
    assert strict("#### 72", "72", prompt_id="p1", other=3) == 1.0
    assert format_reward("#### 72", "72", prompt_id="p1") == 1.0


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"The answer is $\boxed{\frac{1}{2}}$", "0.5", 1.0),
        ("x = 1/3", r"\frac{1}{3}", 1.0),
        (r"$\boxed{3}$", "#### 4", 0.0),
        ("Step one.\n#### 72", GSM8K_ANSWER, 1.0),
        ("I do not know", "7", 0.0),
    ],
)
def test_math_verify(completion, answer, expected):
    assert math_verify(completion, answer) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("work\n#### 72", 1.0),
        ("#### -1,234.5", 1.0),
        ("  ####  $40.  \nthanks", 1.0),
        ("The answer is #### 72 apples", 0.0),  # not on its own line
        ("#### 72 apples", 0.0),
        ("#### ", 0.0),
        ("72", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(completion) == expected
