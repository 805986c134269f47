"""Synthetic GSM8K-format generator: determinism, format, correctness, difficulty."""

import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from rltt.data.gsm8k import extract_final_answer
from rltt.data.synthetic import (
    DIFFICULTY_PRESETS,
    Difficulty,
    apply_op,
    generate,
    generate_problem,
    iter_problems,
    resolve_difficulty,
    write_jsonl,
)
from rltt.errors import RlttError


def test_same_seed_same_problems_other_seed_differs():
    assert generate(20, "quickstart", seed=3) == generate(20, "quickstart", seed=3)
    assert generate(20, "quickstart", seed=3) != generate(20, "quickstart", seed=4)


def test_problem_depends_only_on_seed_and_index():
    stream = generate(30, "medium", seed=1)
    assert generate(10, "medium", seed=1, start=20) == stream[20:]
    it = iter_problems("medium", seed=1, start=5)
    assert next(it).to_record() == stream[5]


def test_records_look_like_gsm8k():
    for record in generate(50, "hard", seed=0):
        assert set(record) == {"id", "question", "answer"}
        assert record["question"].endswith("have now?")
        assert re.search(r"\n#### \d+$", record["answer"])
    assert len({r["id"] for r in generate(50)}) == 50


@settings(max_examples=150, deadline=None)
@given(
    index=st.integers(0, 10**6),
    seed=st.integers(0, 1000),
    preset=st.sampled_from(sorted(p for p, d in DIFFICULTY_PRESETS.items() if isinstance(d, Difficulty))),  # chains: test_chains
)
def test_answer_is_the_recomputed_result(index, seed, preset):
    problem = generate_problem(index, preset, seed)
    diff = DIFFICULTY_PRESETS[preset]
    # recompute independently from the structured form
    value = problem.start
    for step in problem.steps:
        assert step.before == value
        value = apply_op(step.op, value, step.operand)
        assert step.after == value
        assert 1 <= value <= diff.max_value
        assert step.op in diff.ops
    assert extract_final_answer(problem.answer) == str(value) == str(problem.result)
    assert problem.answer.endswith(f"#### {value}")
    # every calculator annotation is arithmetically right
    for expr, result in re.findall(r"<<([^=]+)=(\d+)>>", problem.answer):
        a, op, b = re.fullmatch(r"(\d+)([-+*/])(\d+)", expr).groups()
        assert apply_op({"+": "add", "-": "sub", "*": "mul", "/": "div"}[op], int(a), int(b)) == int(result)
    # the question mentions every operand, in order
    numbers = [int(n) for n in re.findall(r"\d+", problem.question)]
    assert numbers == [problem.start] + [s.operand for s in problem.steps]
    lo, hi = diff.op_range
    assert lo <= len(problem.steps) <= hi


@pytest.mark.parametrize("num_ops", [1, 2, 4, 7])
def test_num_ops_sets_operation_count(num_ops):
    diff = Difficulty(num_ops=num_ops, max_value=30)
    for i in range(40):
        problem = generate_problem(i, diff)
        assert len(problem.steps) == num_ops
        assert problem.answer.count("<<") == num_ops


def test_op_range_and_max_value():
    diff = Difficulty(num_ops=3, min_ops=1, max_value=12)
    counts = {len(generate_problem(i, diff).steps) for i in range(200)}
    assert counts == {1, 2, 3}
    easy = [generate_problem(i, "easy") for i in range(200)]
    assert all(len(p.steps) == 1 and p.result <= 9 and p.start <= 9 for p in easy)
    # presets get harder
    mean_ops = [sum(len(generate_problem(i, name).steps) for i in range(100)) for name in ("trivial", "quickstart", "hard")]
    assert mean_ops == sorted(mean_ops) and mean_ops[0] < mean_ops[-1]


def test_calculator_annotations_optional():
    problem = generate_problem(0, Difficulty(num_ops=2, max_value=20, calculator=False))
    assert "<<" not in problem.answer and problem.answer.endswith(f"#### {problem.result}")


def test_resolve_difficulty_and_errors():
    assert resolve_difficulty("hard") is DIFFICULTY_PRESETS["hard"]
    assert resolve_difficulty({"preset": "hard", "max_value": 40}).max_value == 40
    assert resolve_difficulty({"num_ops": 3}).num_ops == 3
    with pytest.raises(RlttError, match="unknown synthetic difficulty 'impossible'"):
        resolve_difficulty("impossible")
    with pytest.raises(RlttError, match="bogus"):
        resolve_difficulty({"bogus": 1})
    with pytest.raises(RlttError, match="num_ops"):
        Difficulty(num_ops=0)
    with pytest.raises(RlttError, match="ops"):
        Difficulty(ops=("mul", "div"))


def test_write_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "sub" / "syn.jsonl", 25, "easy", seed=7)
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == generate(25, "easy", seed=7)
