"""MATH-style sets: MATH-500, AIME and MATH-train layouts load as records (JSONL, Parquet, a
directory, the hub), and math_verify scores \\boxed{} answers against them. Every sample here is
written by the test (made-up problems in each layout), none is copied from a public set."""

import json

import pytest

from rltt.data.gsm8k import load_gsm8k
from rltt.data.math_sets import LAYOUTS, last_boxed, layout_of, to_record
from rltt.errors import RlttError
from rltt.orchestration.prompt_stream import eval_tasks

MATH500 = [
    {"problem": "What is $\\frac{7}{3} + \\frac{7}{3}$?", "solution": "Add: $\\boxed{\\frac{14}{3}}$.",
     "answer": "\\frac{14}{3}", "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"},
    {"problem": "Solve $x^2 = 9$ for $x > 0$.", "solution": "$x = \\boxed{3}$.", "answer": "3",
     "subject": "Algebra", "level": 2, "unique_id": "test/algebra/2.json"},
]
AIME_CAPITALISED = [{"ID": "2030-I-1", "Problem": "Find the remainder when $2^{10}$ is divided by $1000$.",
                     "Solution": "$1024 - 1000 = 24$.", "Answer": 24},
                    {"ID": "2030-I-2", "Problem": "How many positive divisors has $36$?", "Answer": 9}]
AIME_LOWER = [{"id": 60, "problem": "Compute $7 \\cdot 11 \\cdot 13$.", "answer": "1001", "year": 2031}]
AIME_NO_ID = [{"problem": "What is $3^5$?", "answer": "243"}]
MATH_TRAIN = [{"problem": "Simplify $\\sqrt{8}$.", "level": "Level 2", "type": "Algebra",
               "solution": "We have $\\sqrt{8} = \\sqrt{4}\\sqrt{2} = \\boxed{2\\sqrt{2}}$."},
              {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "level": "Level 1", "type": "Prealgebra",
               "solution": "Common denominator: \\boxed{\\frac{3}{4}}"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_math500_layout(tmp_path):
    records = load_gsm8k(write_jsonl(tmp_path / "math500.jsonl", MATH500))
    assert records[0] == {"question": MATH500[0]["problem"], "answer": "\\frac{14}{3}", "layout": "math500",
                          "id": "test/prealgebra/1.json", "subject": "Prealgebra", "level": 1}
    assert [r["id"] for r in records] == ["test/prealgebra/1.json", "test/algebra/2.json"]
    assert load_gsm8k(tmp_path / "math500.jsonl", limit=1) == records[:1]


@pytest.mark.parametrize("rows, ids, answers", [
    (AIME_CAPITALISED, ["2030-I-1", "2030-I-2"], ["24", "9"]),
    (AIME_LOWER, ["60"], ["1001"]),
    (AIME_NO_ID, ["aime-1"], ["243"]),  # no id field: the file stem and line, as for GSM8K
])
def test_aime_layouts(tmp_path, rows, ids, answers):
    records = load_gsm8k(write_jsonl(tmp_path / "aime.jsonl", rows))
    assert [r["id"] for r in records] == ids and [r["answer"] for r in records] == answers
    assert all(r["layout"] == "aime" and r["question"] for r in records)
    if rows is AIME_LOWER:
        assert records[0]["year"] == 2031


def test_math_train_layout_takes_the_last_boxed_answer(tmp_path):
    records = load_gsm8k(write_jsonl(tmp_path / "train.jsonl", MATH_TRAIN))
    assert [r["answer"] for r in records] == ["2\\sqrt{2}", "\\frac{3}{4}"]
    assert records[0]["layout"] == "math" and records[0]["type"] == "Algebra" and records[0]["id"] == "train-1"
    assert last_boxed("\\boxed{1} then \\fbox{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{unclosed") is None


def test_directory_and_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "test.jsonl", MATH500)
    assert [r["id"] for r in load_gsm8k(tmp_path, "test")] == ["test/prealgebra/1.json", "test/algebra/2.json"]
    pq.write_table(pa.Table.from_pylist(AIME_CAPITALISED), tmp_path / "aime.parquet")
    records = load_gsm8k(tmp_path / "aime.parquet")
    assert [(r["id"], r["answer"]) for r in records] == [("2030-I-1", "24"), ("2030-I-2", "9")]


def test_gsm8k_records_are_unchanged(tmp_path):
    rows = [{"question": "What is 1 + 1?", "answer": "#### 2"}]
    assert load_gsm8k(write_jsonl(tmp_path / "g.jsonl", rows)) == [{**rows[0], "id": "g-1"}]
    assert layout_of(rows[0]) is None and [l.name for l in LAYOUTS] == ["math500", "aime", "math"]


def test_bad_records_are_one_line_errors(tmp_path):
    with pytest.raises(RlttError, match=r"b.jsonl:1: a MATH-style record .* needs an 'answer'"):
        load_gsm8k(write_jsonl(tmp_path / "b.jsonl", [{"problem": "p"}]))
    with pytest.raises(RlttError, match=r"c.jsonl:1: the solution has no \\boxed"):
        load_gsm8k(write_jsonl(tmp_path / "c.jsonl", [{"problem": "p", "solution": "it is 3"}]))
    with pytest.raises(RlttError, match="field 'answer' must be text or a number"):
        to_record({"problem": "p", "answer": [1]}, "x")
    with pytest.raises(RlttError, match="missing or non-string field 'question'"):
        load_gsm8k(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "1"}]))


def test_hub_sets_load_their_default_config(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def load(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_list(MATH500)

    monkeypatch.setattr(datasets, "load_dataset", load)
    records = load_gsm8k("HuggingFaceH4/MATH-500", "test")
    assert calls == [("HuggingFaceH4/MATH-500", None, "test")] and records[1]["answer"] == "3"


def test_eval_tasks_from_a_math500_file(tmp_path):
    source = str(write_jsonl(tmp_path / "math500.jsonl", MATH500))
    tasks = eval_tasks(source, "synthetic:quickstart", lambda s: list(s.encode()), "Problem: {question}\nSolution:",
                       "test", 5, 0)
    assert [t.id for t in tasks] == ["test/prealgebra/1.json", "test/algebra/2.json"]
    assert tasks[0].answer == "\\frac{14}{3}" and tasks[0].prompt.startswith("Problem: What is")


def test_math_verify_scores_boxed_answers_against_each_layout():
    pytest.importorskip("math_verify")
    from rewards.math import math_verify

    think = "<think>work it out</think>\n"
    assert math_verify(think + "So $\\boxed{\\frac{28}{6}}$.", "\\frac{14}{3}") == 1.0
    assert math_verify(think + "So $\\boxed{\\frac{13}{3}}$.", "\\frac{14}{3}") == 0.0
    assert math_verify(think + "The remainder is $\\boxed{24}$.", "24") == 1.0
    assert math_verify(think + "$\\boxed{2\\sqrt{2}}$", "2\\sqrt{2}") == 1.0
    assert math_verify(think + "$\\boxed{0.75}$", "\\frac{3}{4}") == 1.0
