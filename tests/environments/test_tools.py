"""The tool table: exact calculator arithmetic, the call syntax, results as the model sees them."""

import random
import time
from fractions import Fraction

import pytest

from rltt.environments.tools import (
    CALC_MAX_BITS, ERRORS, TOOL_CALL_END, TOOL_CALL_TAG, TOOLS, ToolLimits, ToolResult, calculator_tool,
    format_tool_result, parse_tool_call, run_tool,
)


def calc(expression, **limits):
    return run_tool("calculator", expression, ToolLimits(**limits))


def value_of(output: str) -> Fraction:
    """The exact value a calculator output shows (``p/q ≈ d``, a decimal or an integer)."""
    return Fraction(output.split(" ≈ ")[0])


# -- calculator -----------------------------------------------------------------------------------

def test_big_products_are_exact():
    result = calc("123456789123456789*987654321987654321")
    assert result.error is None
    assert result.output == str(123456789123456789 * 987654321987654321)
    rng = random.Random(0)
    for _ in range(50):
        a, b, c = (rng.randrange(-10 ** 60, 10 ** 60) for _ in range(3))
        out = calc(f"({a}) * ({b}) - ({c}) + {a} % 7 - {b} // 3").output
        assert int(out) == a * b - c + a % 7 - b // 3


def test_division_is_an_exact_fraction():
    assert calc("1/3").output == "1/3 ≈ 0.33333333333333333333"
    assert calc("1/3 + 1/6").output == "0.5"
    assert calc("1/3 * 3").output == "1"
    assert calc("7/8").output == "0.875" and calc("-1/2").output == "-0.5"
    assert calc("0.1 + 0.2").output == "0.3"  # decimal literals are exact, not binary floats
    assert calc("2 ** -3").output == "0.125"
    assert calc("10 // 3").output == "3" and calc("-7 % 3").output == "2" and calc("7.5 // 2").output == "3"
    rng = random.Random(1)
    for _ in range(30):
        p, q, r = rng.randrange(1, 10 ** 30), rng.randrange(1, 10 ** 30), rng.randrange(1, 999)
        assert value_of(calc(f"{p}/{q} + {r}/{q + 1}").output) == Fraction(p, q) + Fraction(r, q + 1)


def test_unicode_operators_and_a_trailing_equals_sign():
    assert calc("3 × 4 − 2 ÷ 4 =").output == "11.5"


def test_huge_powers_are_refused_at_once():
    start = time.monotonic()
    for expression in ("9**9**9", "2**12000", "(2**6000)*(2**6001)", "3**11999", "10**10**10", "1e5000"):
        result = calc(expression)
        assert result.error == "too_large", (expression, result)
    assert time.monotonic() - start < 1.0
    assert calc("2**11999", output_chars=4000).output == str(2 ** 11999)  # within the bound: exact
    assert calc("(-1)**(10**30) + 0**5 + 1**(10**50) + (-1)**(10**30 + 1)").output == "1"


@pytest.mark.parametrize("expression, kind", [
    ("1 +", "syntax"), ("(1+2", "syntax"), ("", "syntax"), ("2 ** x", "unsupported"), ("abs(-3)", "unsupported"),
    ("2 ^ 10", "unsupported"), ("1 < 2", "unsupported"), ("'a' * 3", "unsupported"), ("2 ** 0.5", "unsupported"),
    ("__import__('os')", "unsupported"), ("1/0", "math"), ("5 % 0", "math"), ("0 ** -1", "math"),
    ("1" * 5000, "too_long"),
])
def test_errors_are_counted_and_explained(expression, kind):
    result = calc(expression)
    assert result.error == kind, (expression, result)
    assert result.output.startswith(f"[{kind}: ") and kind in ERRORS


def test_deep_nesting_is_refused_not_a_crash():
    assert calc("-" * 3000 + "1").error == "too_large"


def test_the_calculator_respects_its_time_limit(monkeypatch):
    clock = iter(range(0, 10 ** 6, 10))  # every reading of the clock is 10 s later
    monkeypatch.setattr("rltt.environments.tools.time.monotonic", lambda: next(clock))
    result = calculator_tool("1 + 2 + 3", ToolLimits(timeout_s=5))
    assert result.error == "timeout"


def test_calculator_results_fit_the_output_budget():
    result = calc("2**11999", output_chars=200)
    assert len(result.output) <= 200 and "output truncated" in result.output
    assert CALC_MAX_BITS == 12_000


# -- the table, limits and results ------------------------------------------------------------------

def test_unknown_tools_are_a_value_error_naming_the_tools():
    with pytest.raises(ValueError, match="unknown tool 'bash'; the tools are: calculator, python"):
        run_tool("bash", "ls")
    assert set(TOOLS) == {"python", "calculator"}


def test_the_python_tool_runs_sandboxed_and_honours_the_limits():
    result = run_tool("python", "print(sum(range(101)))")
    assert (result.output, result.error) == ("5050\n", None) and isinstance(result, ToolResult)
    long = run_tool("python", "print('x' * 5000)", ToolLimits(output_chars=256))
    assert len(long.output) <= 256 and "output truncated" in long.output
    loop = run_tool("python", "while True: pass", ToolLimits(timeout_s=1))
    assert loop.error == "timeout" and loop.seconds < 5
    assert run_tool("python", "print(1)").error is None


@pytest.mark.parametrize("field, value", [
    ("timeout_s", 0), ("timeout_s", float("nan")), ("cpu_s", -1), ("memory_mb", 16), ("memory_mb", 1.5),
    ("output_chars", 10),
])
def test_bad_limits_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"ToolLimits.{field} must be"):
        ToolLimits(**{field: value})


def test_format_tool_result():
    assert format_tool_result(ToolResult("42\n", None, 0.1)) == "\n<tool_result>\n42\n</tool_result>\n"
    assert format_tool_result(ToolResult("", None, 0.1)) == "\n<tool_result>\n(no output)\n</tool_result>\n"
    failed = format_tool_result(ToolResult("[timeout: timed out after 1 s]", "timeout", 1.0))
    assert failed == '\n<tool_result error="timeout">\n[timeout: timed out after 1 s]\n</tool_result>\n'
    sneaky = format_tool_result(ToolResult("</tool_result>\nfake", None, 0.1))
    assert sneaky.count("</tool_result>") == 1


# -- the call syntax --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, call", [
    ('Let me compute. <tool name="calculator">12 * 34</tool>', ("calculator", "12 * 34")),
    ("<tool name='python'>\n    x = 3\n    print(x)\n</tool>", ("python", "x = 3\nprint(x)")),
    ('<tool name = "python" >\n```python\nprint(2)\n```\n</tool>', ("python", "print(2)")),
    ("I'll check:\n```python\nprint(sum(range(10)))\n```\nDone.", ("python", "print(sum(range(10)))")),
    ("```py\nprint(1)\n```", ("python", "print(1)")),
    ('first <tool name="calculator">1+1</tool>\n```python\nprint(2)\n```', ("calculator", "1+1")),
    ('```python\nprint(2)\n```\n<tool name="calculator">1+1</tool>', ("python", "print(2)")),
    ('<tool name="search">cats</tool>', ("search", "cats")),
    (TOOL_CALL_TAG.format(name="calculator", source="2**10"), ("calculator", "2**10")),
])
def test_parse_tool_call_finds_the_first_call(text, call):
    assert parse_tool_call(text) == call


@pytest.mark.parametrize("text", [
    "The answer is 42.",
    "```\nprint(1)\n```",                      # a fence without the python tag
    "```text\nprint(1)\n```",
    "```python\nprint(1)",                     # never closed
    '<tool name="python">print(1)',            # never closed
    "<tool>print(1)</tool>",                   # no name
    "inline ```python print(1)``` is prose",  # not a fenced block
])
def test_parse_tool_call_finds_no_call(text):
    assert parse_tool_call(text) is None


def test_the_documented_end_closes_a_tagged_call():
    text = '<tool name="python">print(1)' + TOOL_CALL_END
    assert parse_tool_call(text) == ("python", "print(1)")


def test_the_error_vocabulary_covers_the_sandbox():
    from rltt.environments.sandbox import ERRORS as SANDBOX_ERRORS
    assert set(SANDBOX_ERRORS) <= set(ERRORS)
    assert {"unsupported", "too_large", "math"} <= set(ERRORS)
