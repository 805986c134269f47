"""rltt.data.chains: multi-hop lookups whose answer is resolved by following the bindings, with
distractor chains, through the synthetic presets, streams, documents and held-out problems."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rltt.data import synthetic
from rltt.data.chains import ChainDifficulty, ChainProblem
from rltt.data.gsm8k import extract_final_answer
from rltt.data.text import SyntheticSource
from rltt.errors import RlttError
from rltt.orchestration.prompt_stream import load_records

BINDING = re.compile(r"Let ([a-z]) = ([a-z]|\d+)\.")


def solve(question: str) -> tuple[int, int]:
    """The asked variable's value and its hop count, by following the bindings in the text."""
    bindings = dict(BINDING.findall(question))
    name = re.search(r"What is ([a-z])\?$", question).group(1)
    hops = 0
    while not bindings[name].isdigit():
        name, hops = bindings[name], hops + 1
    return int(bindings[name]), hops


@settings(max_examples=60, deadline=None)
@given(hops=st.integers(0, 6), distractors=st.integers(0, 2), index=st.integers(0, 10_000),
       seed=st.integers(0, 50))
def test_the_answer_is_the_value_hops_lookups_away(hops, distractors, index, seed):
    problem = ChainDifficulty(hops=hops, distractors=distractors).problem(index, seed)
    value, found = solve(problem.question)
    assert (value, found) == (problem.result, hops) and problem.hops == hops
    assert problem.answer == f"#### {value}" and extract_final_answer(problem.answer) == str(value)
    statements = BINDING.findall(problem.question)
    assert len(statements) == (hops + 1) * (distractors + 1)
    names = [n for n, _ in statements]
    assert len(set(names)) == len(names)  # every variable bound once
    roots = [int(v) for _, v in statements if v.isdigit()]
    assert len(roots) == distractors + 1 and len(set(roots)) == len(roots)  # the number in sight is not enough


def test_streams_are_deterministic_and_seeded():
    d = ChainDifficulty(hops=3)
    assert d.problem(5, 1) == d.problem(5, 1)
    assert d.problem(5, 1).question != d.problem(5, 2).question
    assert [d.problem(i, 0).question for i in range(20)] != [d.problem(i, 0).question for i in range(1, 21)]


def test_presets_ranges_and_show_work():
    mixed = synthetic.resolve_difficulty("chains")
    assert mixed.hop_range == (1, 4)
    assert {mixed.problem(i).hops for i in range(200)} == {1, 2, 3, 4}
    assert synthetic.resolve_difficulty("chains-5").hops == 5
    easy = synthetic.resolve_difficulty("chains-easy")  # the curriculum: the direct lookup among the chains
    assert easy.hop_range == (0, 3) and {easy.problem(i).hops for i in range(200)} == {0, 1, 2, 3}
    direct = synthetic.resolve_difficulty("chains-0").problem(4)
    assert solve(direct.question) == (direct.result, 0)
    assert all(v.isdigit() for _, v in BINDING.findall(direct.question))  # every variable holds a number
    shown = synthetic.resolve_difficulty({"preset": "chains-2", "show_work": True}).problem(0)
    target = re.search(r"What is ([a-z])\?", shown.question).group(1)
    assert shown.answer.startswith(f"{target} = ") and shown.answer.endswith(f"= {shown.result}\n#### {shown.result}")
    built = synthetic.resolve_difficulty({"task": "chains", "hops": 4, "distractors": 1})
    assert built == ChainDifficulty(hops=4, distractors=1)
    assert isinstance(synthetic.resolve_difficulty({"num_ops": 2}), synthetic.Difficulty)  # arithmetic by default


@pytest.mark.parametrize("fields, message", [
    ({"task": "chains", "hops": -1}, "hops must be >= 0"),
    ({"task": "chains", "hops": 3, "min_hops": 4}, "min_hops must be in 0..hops=3"),
    ({"task": "chains", "hops": 8, "distractors": 3}, "exceed the 26 letters"),
    ({"task": "chains", "distractors": 9, "max_value": 9}, "no distinct root"),
    ({"task": "chains", "num_ops": 2}, "unknown field"),
    ({"task": "lookup"}, "unknown task 'lookup'"),
])
def test_bad_difficulties_are_one_line_errors(fields, message):
    with pytest.raises(RlttError, match=message):
        synthetic.resolve_difficulty(fields)


def test_rl_records_documents_and_held_out_problems():
    records = load_records("synthetic:chains-3", count=4, seed=7)
    assert [r["id"] for r in records] == [f"chains-7-{i}" for i in range(4)]
    assert all(solve(r["question"]) == (int(r["answer"][5:]), 3) for r in records)
    source = SyntheticSource("chains-2")
    doc = source.document(3)
    problem = synthetic.generate_problem(3, "chains-2")
    assert isinstance(problem, ChainProblem) and problem.question in doc and doc.rstrip().endswith(problem.answer)
    assert source.num_documents is None
    from rltt.lm_training.corpus import eval_problems
    from rltt.lm_training.stage_recipe import TextDataSection

    held = eval_problems(TextDataSection(source="synthetic:chains-4"), 3)
    assert all(isinstance(p, ChainProblem) and p.hops == 4 and solve(p.question)[0] == p.result for p in held)
