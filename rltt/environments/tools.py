"""Tools a policy can call from a multi-turn episode: ``python`` and ``calculator`` (docs/tools.md).

A model turn calls a tool in plain text, in one of two forms; `parse_tool_call` takes the FIRST
call in the turn:

    <tool name="calculator">123456789123456789 * 987654321987654321</tool>

    ```python
    print(sum(range(10)))
    ```

(A tagged call names any tool in `TOOLS`; a fenced block tagged ``python`` or ``py`` is a
``python`` call.) `run_tool` runs it under `ToolLimits` and returns a `ToolResult`;
`format_tool_result` renders the text appended to the conversation after the turn:

    <tool_result>
    121932631356500531347203169112635269
    </tool_result>

and ``<tool_result error="timeout">`` when the call failed. ``ToolResult.error`` is None or one of
the keys of `ERRORS` — a fixed vocabulary, so failures can be counted per kind.

``python`` runs the code in a fresh sandboxed interpreter (`rltt.environments.sandbox`).
``calculator`` evaluates one arithmetic expression exactly, in-process: the expression is parsed
with `ast` and only number literals, ``+ - * / // % **``, unary signs and parentheses are
evaluated (never ``eval``); integers are Python ints and every other value a `Fraction`, so no
result is rounded; any intermediate value larger than `CALC_MAX_BITS` is refused before it is
computed (``9**9**9`` is refused at once, not hung).
"""

from __future__ import annotations

import ast
import math
import re
import textwrap
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation, localcontext
from fractions import Fraction
from typing import Callable

from rltt.environments import sandbox
from rltt.environments.sandbox import truncate


@dataclass(frozen=True)
class ToolLimits:
    """What one tool call may use."""

    timeout_s: float = 5.0          # wall clock per call (process start included)
    cpu_s: float = 5.0              # RLIMIT_CPU, rounded up to whole seconds
    memory_mb: int = 512            # RLIMIT_AS (address space)
    output_chars: int = 1024        # output truncated to this budget, with a marker saying so

    def __post_init__(self):
        for name, low in (("timeout_s", 0.0), ("cpu_s", 0.0)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > low):
                raise ValueError(f"ToolLimits.{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.memory_mb, int) or self.memory_mb < MIN_MEMORY_MB:
            raise ValueError(f"ToolLimits.memory_mb must be an integer >= {MIN_MEMORY_MB} (the interpreter "
                             f"itself needs that much address space), got {self.memory_mb!r}")
        if not isinstance(self.output_chars, int) or self.output_chars < MIN_OUTPUT_CHARS:
            raise ValueError(f"ToolLimits.output_chars must be an integer >= {MIN_OUTPUT_CHARS} (room for the "
                             f"truncation marker and an error line), got {self.output_chars!r}")


#: Smallest limits a `ToolLimits` accepts.
MIN_MEMORY_MB = 64
MIN_OUTPUT_CHARS = 128


@dataclass(frozen=True)
class ToolResult:
    """One tool call's outcome."""

    output: str                     # what the model sees (already truncated)
    error: str | None               # None on success, else a key of ERRORS
    seconds: float


#: Every value ``ToolResult.error`` takes, with what it means.
ERRORS = {
    **sandbox.ERRORS,
    "unsupported": "the calculator does not evaluate this (a name, a call, ^, a comparison, a "
                   "non-integer power...)",
    "too_large": "a calculator value would exceed the size bound (CALC_MAX_BITS bits)",
    "math": "an undefined operation (division by zero)",
}


# -- python --------------------------------------------------------------------------------------

def python_tool(source: str, limits: ToolLimits) -> ToolResult:
    """Run ``source`` in a fresh sandboxed interpreter (`rltt.environments.sandbox.run_python`)."""
    run = sandbox.run_python(source, timeout_s=limits.timeout_s, cpu_s=limits.cpu_s,
                             memory_mb=limits.memory_mb, output_chars=limits.output_chars)
    return ToolResult(run.output, run.error, run.seconds)


# -- calculator ----------------------------------------------------------------------------------

#: Largest magnitude, in bits, of any integer, numerator or denominator the calculator makes
#: (about 3,600 decimal digits; below Python's 4,300-digit int/str conversion limit).
CALC_MAX_BITS = 12_000
#: Longest expression the calculator parses.
CALC_MAX_CHARS = 4_000
#: Digits after the point shown exactly for a terminating decimal; other fractions show as p/q.
_EXACT_DECIMALS = 60
_APPROX_DIGITS = 20

_SPELLINGS = str.maketrans({"×": "*", "÷": "/", "−": "-", "–": "-"})


class _CalcError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _bits(value: int | Fraction) -> int:
    if isinstance(value, int):
        return value.bit_length()
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def _bounded(value: int | Fraction) -> int | Fraction:
    if isinstance(value, Fraction) and value.denominator == 1:
        value = value.numerator
    if _bits(value) > CALC_MAX_BITS:
        raise _CalcError("too_large", f"a value has more than {CALC_MAX_BITS} bits (about "
                                      f"{int(CALC_MAX_BITS * math.log10(2))} digits)")
    return value


def _power(base: int | Fraction, exponent: int | Fraction) -> int | Fraction:
    if isinstance(exponent, Fraction):  # not an integer (integral values are ints already)
        raise _CalcError("unsupported", "a non-integer exponent: the result would not be exact")
    if base == 0 and exponent < 0:
        raise _CalcError("math", "division by zero (0 to a negative power)")
    if base in (0, 1) or exponent == 0:
        return 1 if exponent == 0 else base
    if base == -1:
        return 1 if exponent % 2 == 0 else -1
    # |base ** e| has at least (bits(base) - 1) * |e| + 1 bits in its numerator or denominator
    if (_bits(base) - 1) * abs(exponent) + 1 > CALC_MAX_BITS:
        raise _CalcError("too_large", f"the power would have more than {CALC_MAX_BITS} bits")
    result = Fraction(base) ** exponent if exponent < 0 else base ** exponent
    return result


def _binary(op: ast.operator, a, b):
    if isinstance(op, ast.Add):
        return a + b
    if isinstance(op, ast.Sub):
        return a - b
    if isinstance(op, ast.Mult):
        return a * b
    if isinstance(op, ast.Pow):
        return _power(a, b)
    if b == 0:
        raise _CalcError("math", "division by zero")
    if isinstance(op, ast.Div):
        return Fraction(a, b) if isinstance(a, int) and isinstance(b, int) else Fraction(a) / b
    if isinstance(op, ast.FloorDiv):
        return a // b
    return a % b  # Mod


_BINARY = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_OP_TEXT = {ast.BitXor: "^ (use ** for powers)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
            ast.RShift: ">>", ast.MatMult: "@", ast.Invert: "~", ast.Not: "not"}


class _Evaluator:
    def __init__(self, text: str, deadline: float):
        self.text = text
        self.deadline = deadline

    def __call__(self, node: ast.AST) -> int | Fraction:
        if time.monotonic() > self.deadline:
            raise _CalcError("timeout", "the calculation passed its time limit")
        if isinstance(node, ast.Expression):
            return self(node.body)
        if isinstance(node, ast.Constant):
            return self._literal(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            value = self(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY):
            a, b = self(node.left), self(node.right)
            if isinstance(node.op, ast.Mult) and _bits(a) + _bits(b) > CALC_MAX_BITS + 1:
                raise _CalcError("too_large", f"the product would have more than {CALC_MAX_BITS} bits")
            return _bounded(_binary(node.op, a, b))
        op = getattr(node, "op", None)
        shown = _OP_TEXT.get(type(op)) or type(node).__name__.lower()
        if isinstance(node, ast.Name):
            shown = f"the name {node.id!r}"
        elif isinstance(node, ast.Call):
            shown = "a function call"
        raise _CalcError("unsupported", f"{shown} is not supported: only numbers, + - * / // % ** "
                                        f"and parentheses")

    def _literal(self, node: ast.Constant) -> int | Fraction:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _CalcError("unsupported", f"{type(value).__name__} literals are not supported, only numbers")
        if isinstance(value, int):
            return _bounded(value)
        text = ast.get_source_segment(self.text, node) or repr(value)
        try:
            exact = Decimal(text.replace("_", ""))
        except InvalidOperation:
            raise _CalcError("syntax", f"cannot read the number {text!r}") from None
        if not exact.is_finite() or abs(exact.adjusted()) > CALC_MAX_BITS * 0.3:
            raise _CalcError("too_large", f"the number {text!r} is out of range")
        return _bounded(Fraction(exact))


def _show(value: int | Fraction) -> str:
    """An integer in full; a fraction as an exact decimal when it terminates within
    `_EXACT_DECIMALS` digits, else as ``p/q ≈ decimal``."""
    if isinstance(value, int):
        return str(value)
    den = value.denominator
    twos = (den & -den).bit_length() - 1
    rest, fives = den >> twos, 0
    while rest % 5 == 0:
        rest //= 5
        fives += 1
    sign = "-" if value < 0 else ""
    if rest == 1 and max(twos, fives) <= _EXACT_DECIMALS:
        places = max(twos, fives)
        digits = str(abs(value.numerator) * (10 ** places // den)).rjust(places + 1, "0")
        return f"{sign}{digits[:-places]}.{digits[-places:]}"
    with localcontext() as ctx:
        ctx.prec = _APPROX_DIGITS
        approx = Decimal(value.numerator) / Decimal(den)
    return f"{value.numerator}/{den} ≈ {approx}"


def calculate(expression: str, deadline: float = float("inf")) -> str:
    """The exact value of ``expression`` as text; raises `_CalcError` (kind, message) otherwise."""
    text = expression.translate(_SPELLINGS).strip()
    text = text[:-1].rstrip() if text.endswith("=") and not text.endswith("==") else text
    if len(text) > CALC_MAX_CHARS:
        raise _CalcError("too_long", f"the expression has {len(text)} characters; the limit is {CALC_MAX_CHARS}")
    if not text:
        raise _CalcError("syntax", "empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise _CalcError("syntax", exc.msg) from None
    except (ValueError, MemoryError, RecursionError) as exc:  # e.g. an integer literal of > 4300 digits
        raise _CalcError("too_large", str(exc) or type(exc).__name__) from None
    try:
        return _show(_Evaluator(text, deadline)(tree))
    except RecursionError:
        raise _CalcError("too_large", "the expression is nested too deeply") from None


def calculator_tool(source: str, limits: ToolLimits) -> ToolResult:
    """Evaluate one arithmetic expression exactly (module docstring); in-process, bounded, and
    checked against ``limits.timeout_s`` between operations."""
    start = time.monotonic()
    try:
        output, error = calculate(source, start + limits.timeout_s), None
    except _CalcError as exc:
        output, error = f"[{exc.kind}: {exc}]", exc.kind
    return ToolResult(truncate(output, limits.output_chars), error, time.monotonic() - start)


# -- the table, calls and results -----------------------------------------------------------------

TOOLS: dict[str, Callable[[str, ToolLimits], ToolResult]] = {
    "python": python_tool,
    "calculator": calculator_tool,
}


def run_tool(name: str, source: str, limits: ToolLimits = ToolLimits()) -> ToolResult:
    """Run tool ``name`` on ``source``; an unknown name is a ValueError naming the tools."""
    try:
        tool = TOOLS[name]
    except KeyError:
        raise ValueError(f"unknown tool {name!r}; the tools are: {', '.join(sorted(TOOLS))}") from None
    return tool(source, limits)


#: The documented call syntax: ``<tool name="NAME">SOURCE</tool>``; ``TOOL_CALL_END`` is what an
#: episode loop can stop generation on (keep it in the turn: `parse_tool_call` needs the closing tag).
TOOL_CALL_TAG = '<tool name="{name}">{source}</tool>'
TOOL_CALL_END = "</tool>"
_TAG = re.compile(r"""<tool\s+name\s*=\s*(["'])([^"'<>]*)\1\s*>(.*?)</tool\s*>""", re.DOTALL)
_FENCE = re.compile(r"^[ \t]*```[ \t]*(?:python3?|py)[ \t]*\n(.*?)^[ \t]*```", re.DOTALL | re.MULTILINE)
_INNER_FENCE = re.compile(r"\A\s*```[^\n]*\n(.*?)\n?[ \t]*```\s*\Z", re.DOTALL)


def _clean(source: str) -> str:
    inner = _INNER_FENCE.match(source)  # a tagged call whose body is itself a fenced block
    if inner:
        source = inner.group(1)
    return textwrap.dedent(source).strip("\n").rstrip()


def parse_tool_call(text: str) -> tuple[str, str] | None:
    """``(tool name, source)`` of the first call in a model turn, or None when it has none.

    A call is a closed ``<tool name="NAME">…</tool>`` tag (the name as written, which may not be
    in `TOOLS`) or a closed fenced block tagged ``python``/``py`` (the ``python`` tool); an
    unclosed tag or fence is not a call. The source is dedented and stripped of blank edges.
    """
    tag, fence = _TAG.search(text), _FENCE.search(text)
    if tag is not None and (fence is None or tag.start() <= fence.start()):
        return tag.group(2).strip(), _clean(tag.group(3))
    if fence is not None:
        return "python", _clean(fence.group(1))
    return None


def format_tool_result(result: ToolResult) -> str:
    """The text appended to the conversation after a turn that called a tool:
    ``\\n<tool_result>\\nOUTPUT\\n</tool_result>\\n`` (``error="KIND"`` in the tag on a failure;
    "(no output)" for a silent success; a closing tag inside the output is escaped)."""
    body = result.output if result.output.strip() else ("(no output)" if result.error is None else "")
    body = body.rstrip("\n").replace("</tool_result", "<\\/tool_result")
    error = f' error="{result.error}"' if result.error else ""
    return f"\n<tool_result{error}>\n{body}\n</tool_result>\n"
