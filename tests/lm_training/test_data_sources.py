"""Stage data: local JSONL / Parquet files, a `datasets` dataset, and the held-out split."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rltt.lm_training.corpus import eval_problems, held_out_batches, open_sources
from rltt.lm_training.pretraining import pretrain
from rltt.lm_training.stage_recipe import TextDataSection, load_stage_recipe

from .helpers import tiny_pretrain_data


def _texts(n):
    return [f"Doc {i}: the cat sat on mat number {i}." for i in range(n)]


def test_jsonl_source_holds_out_the_last_documents(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(20)))
    sources = open_sources(TextDataSection(source=str(path), held_out_docs=5))
    assert sources.train.num_documents == 15 and sources.held_out.texts == _texts(20)[15:]


def test_parquet_question_answer_source(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"question": ["What is 1+1?"] * 6, "answer": ["#### 2"] * 6}), path)
    sources = open_sources(TextDataSection(source=str(path), held_out_docs=2))
    assert sources.train.document(0) == "Question: What is 1+1?\nAnswer: #### 2"


def test_too_few_documents_is_an_error(tmp_path):
    from rltt.errors import RlttError

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"text": "one"}) + "\n")
    with pytest.raises(RlttError, match="held_out_docs"):
        open_sources(TextDataSection(source=str(path), held_out_docs=1))


def test_datasets_source_from_a_local_directory(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(12)))
    sources = open_sources(TextDataSection(source=f"hf:{folder}", held_out_docs=2))
    assert sources.train.num_documents == 10 and sources.held_out.texts == _texts(12)[10:]


def test_pretrain_on_a_text_file_without_solve_rate(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(64)))
    data = tiny_pretrain_data(tmp_path / "run", data={"source": str(path), "held_out_docs": 8, "block_size": 32})
    result = pretrain(load_stage_recipe("pretrain", data=data, overrides=["train.steps=2", "eval.every=2"]))
    assert "eval/lm_loss" in result.eval and "eval/solve_rate" not in result.eval


def test_held_out_synthetic_problems_are_fixed_and_from_another_seed():
    data = TextDataSection(source="synthetic:quickstart", seed=3)
    a, b = eval_problems(data, 4), eval_problems(data, 4)
    assert [p.question for p in a] == [p.question for p in b]
    assert all(p.id.startswith("synthetic-4-") for p in a)  # seed + 1: not the training stream
    sources = open_sources(data)
    assert sources.held_out.texts[0] != sources.train.document(0)


def test_held_out_batches_shape():
    from rltt.data.tokenizer import train_tokenizer

    data = TextDataSection(source="synthetic:trivial", block_size=16, held_out_docs=8)
    sources = open_sources(data)
    tok = train_tokenizer([sources.train.document(i) for i in range(50)], vocab_size=64, kind="char")
    batches = held_out_batches(sources, tok, data, batch_size=2, num_batches=2)
    assert len(batches) == 2 and tuple(batches[0].shape) == (2, 16)
