"""Pretraining text sources and resumable block packing."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from rltt.data import GSM8K_SAMPLE_DIR
from rltt.data.gsm8k import format_prompt
from rltt.data.synthetic import generate
from rltt.data.text import BlockPacker, ListSource, SyntheticSource, load_documents, open_text_source, record_text
from rltt.errors import RlttError

EOS = 0


def encode(text):
    return [ord(c) for c in text]


def test_record_text():
    assert record_text({"text": "hello"}) == "hello"
    assert record_text({"question": "Q?", "answer": "#### 1"}) == format_prompt("Q?") + " #### 1"
    with pytest.raises(RlttError, match="'text'"):
        record_text({"foo": 1})


def test_sources(tmp_path):
    gsm = open_text_source(GSM8K_SAMPLE_DIR / "train.jsonl")
    assert gsm.num_documents == 64 and gsm.document(0).startswith("Question: Natalia")
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "a"}) + "\n\n" + json.dumps({"text": "b"}) + "\n")
    assert load_documents(tmp_path / "t.jsonl").texts == ["a", "b"]
    pq.write_table(pa.Table.from_pylist([{"text": "x"}, {"text": "y"}]), tmp_path / "t.parquet")
    assert load_documents(tmp_path / "t.parquet").texts == ["x", "y"]
    syn = open_text_source("synthetic:easy", seed=2)
    assert syn.num_documents is None
    record = generate(4, "easy", seed=2)[3]
    assert syn.document(3) == format_prompt(record["question"]) + " " + record["answer"]
    with pytest.raises(RlttError, match="not found"):
        open_text_source(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "a"}) + "\n[1]\n")
    with pytest.raises(RlttError, match=r"bad\.jsonl:2"):
        load_documents(tmp_path / "bad.jsonl")


def test_blocks_are_the_eos_joined_stream():
    docs = ["abc", "de", "fghij"]
    packer = BlockPacker(ListSource(docs), encode, EOS, block_size=4, repeat=False)
    blocks = list(packer)
    stream = [t for d in docs for t in encode(d) + [EOS]]
    assert all(len(b) == 4 for b in blocks)
    assert sum(blocks, []) == stream[: len(stream) // 4 * 4]
    assert packer.next_block() is None


def test_repeat_wraps_epochs():
    packer = BlockPacker(ListSource(["ab", "c"]), encode, EOS, block_size=5)
    blocks = [packer.next_block() for _ in range(3)]
    one_epoch = encode("ab") + [EOS] + encode("c") + [EOS]
    assert sum(blocks, []) == (one_epoch * 4)[:15]
    assert packer.state_dict()["epoch"] == 3


@settings(max_examples=25, deadline=None)
@given(
    block_size=st.integers(1, 40),
    before=st.integers(0, 12),
    shuffle=st.booleans(),
    source_kind=st.sampled_from(["list", "synthetic"]),
)
def test_resume_gives_identical_blocks(block_size, before, shuffle, source_kind):
    if source_kind == "list":
        source = ListSource([f"doc {i} " + "x" * (i % 7) for i in range(9)])
    else:
        source = SyntheticSource("quickstart", seed=5)

    def make():
        return BlockPacker(source, encode, EOS, block_size=block_size, shuffle=shuffle, seed=11)

    reference = make()
    for _ in range(before):
        reference.next_block()
    state = json.loads(json.dumps(reference.state_dict()))  # survives a checkpoint round trip
    expected = [reference.next_block() for _ in range(8)]

    resumed = make()
    resumed.load_state_dict(state)
    assert [resumed.next_block() for _ in range(8)] == expected
    assert resumed.state_dict() == reference.state_dict()


def test_shuffle_changes_order_per_epoch_and_keeps_documents():
    docs = [chr(ord("a") + i) for i in range(10)]
    packer = BlockPacker(ListSource(docs), encode, EOS, block_size=2, shuffle=True, seed=1)
    epochs = [[chr(packer.next_block()[0]) for _ in range(10)] for _ in range(2)]
    assert sorted(epochs[0]) == docs and sorted(epochs[1]) == docs
    assert epochs[0] != epochs[1] and epochs[0] != docs


def test_batch_and_tokenizer():
    from rltt.data.tokenizer import train_tokenizer

    source = SyntheticSource("easy")
    tok = train_tokenizer([source.document(i) for i in range(50)], vocab_size=64, kind="char")
    packer = BlockPacker.from_tokenizer(source, tok, block_size=128)
    batch = packer.batch(3)  # 384 tokens: more than one document
    assert tuple(batch.shape) == (3, 128)
    assert (batch == tok.eos_token_id).any()
    assert BlockPacker(ListSource(["a"]), encode, EOS, 4, repeat=False).batch(1) is None


def test_state_mismatch_and_bad_args():
    packer = BlockPacker(ListSource(["abc"]), encode, EOS, block_size=4)
    with pytest.raises(RlttError, match="block_size"):
        BlockPacker(ListSource(["abc"]), encode, EOS, block_size=8).load_state_dict(packer.state_dict())
    with pytest.raises(RlttError, match="unknown key"):
        packer.load_state_dict({"cursor": 3})
    with pytest.raises(RlttError, match="block_size"):
        BlockPacker(ListSource(["abc"]), encode, EOS, block_size=0)
    with pytest.raises(RlttError, match="no documents"):
        BlockPacker(ListSource([]), encode, EOS, block_size=4)
