"""GSM8K loaders, answer extraction and prompt template."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rltt.data import GSM8K_SAMPLE_DIR
from rltt.data.gsm8k import (
    DEFAULT_TEMPLATE,
    extract_final_answer,
    extract_last_number,
    format_prompt,
    load_gsm8k,
    load_jsonl,
    normalize_number,
)
from rltt.errors import RlttError


def test_sample_ships_with_license():
    assert (GSM8K_SAMPLE_DIR / "LICENSE").read_text().startswith("MIT License")
    assert "MIT" in (GSM8K_SAMPLE_DIR / "README.md").read_text()


@pytest.mark.parametrize("split", ["train", "test"])
def test_load_sample(split):
    records = load_gsm8k(GSM8K_SAMPLE_DIR, split)
    assert len(records) == 64
    assert len({r["id"] for r in records}) == 64
    for r in records:
        assert extract_final_answer(r["answer"]) is not None
    if split == "train":
        assert records[0]["question"].startswith("Natalia sold clips")
        assert extract_final_answer(records[0]["answer"]) == "72"
        assert records[0]["id"] == "train-1"


def test_limit_and_parquet_equals_jsonl(tmp_path):
    records = load_gsm8k(GSM8K_SAMPLE_DIR / "train.jsonl", limit=5)
    assert len(records) == 5
    table = pa.Table.from_pylist([{"question": r["question"], "answer": r["answer"]} for r in records])
    pq.write_table(table, tmp_path / "train.parquet")
    from_parquet = load_gsm8k(tmp_path / "train.parquet")
    assert [(r["question"], r["answer"]) for r in from_parquet] == [(r["question"], r["answer"]) for r in records]
    # a directory holding train.parquet
    assert len(load_gsm8k(tmp_path, "train")) == 5
    assert len(load_gsm8k(tmp_path, "train", limit=2)) == 2


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "q", "answer": "#### 1"})
    path.write_text(good + "\n" + good + "\n{not json\n")
    with pytest.raises(RlttError, match=r"bad\.jsonl:3: malformed JSON"):
        load_jsonl(path)
    path.write_text(good + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(RlttError, match=r"bad\.jsonl:2: .*'answer'"):
        load_gsm8k(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(RlttError, match="not found: .*nope.jsonl"):
        load_gsm8k(tmp_path / "nope.jsonl")
    with pytest.raises(RlttError, match="no dev.jsonl or dev.parquet"):
        load_gsm8k(tmp_path, "dev")
    with pytest.raises(RlttError, match="not found"):
        load_gsm8k(str(tmp_path / "a" / "b" / "c"))


def test_hub_id_offline_is_a_clear_error(monkeypatch, tmp_path):
    datasets = pytest.importorskip("datasets")
    calls = []

    def offline(name, config, split):
        calls.append((name, config, split))
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RlttError, match="could not load dataset 'openai/gsm8k'.*local JSONL/Parquet path") as info:
        load_gsm8k("openai/gsm8k", "test")
    assert "\n" not in str(info.value)
    assert calls == [("openai/gsm8k", "main", "test")]


def test_hub_records(monkeypatch):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": "q1", "answer": "#### 1"}, {"question": "q2", "answer": "#### 2"}]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, split: datasets.Dataset.from_list(rows))
    records = load_gsm8k("openai/gsm8k", "train", limit=1)
    assert records == [{"question": "q1", "answer": "#### 1", "id": "train-0"}]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so 5 + 3 = 8\n#### 8", "8"),
        ("#### 1,234", "1234"),
        ("#### $1,000.50", "1000.50"),
        ("#### -7", "-7"),
        ("#### $-7", "-7"),
        ("####   0.25.", "0.25"),
        ("#### 3\nmore text\n#### 4", "4"),
        ("no answer here 42", None),
        ("#### seven", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_numbers():
    assert extract_last_number("I had 3 apples, then 1,200 and finally -4.5.") == "-4.5"
    assert extract_last_number("nothing") is None
    assert normalize_number(" $2,000 ") == "2000"
    assert normalize_number("5-") is None
    assert normalize_number("1.2.3") is None


def test_format_prompt():
    assert format_prompt("What is 2+2?") == "Question: What is 2+2?\nAnswer:"
    assert DEFAULT_TEMPLATE.count("{question}") == 1
    assert format_prompt("x", "{literal} Q: {question} A:") == "{literal} Q: x A:"
    with pytest.raises(RlttError, match="question"):
        format_prompt("x", "no placeholder")
