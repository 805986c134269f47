"""Local tokenizer training: round trip, special tokens, save/load, determinism."""

import pytest
from hypothesis import given, settings, strategies as st
from transformers import AutoTokenizer

from rltt.data.synthetic import generate
from rltt.data.tokenizer import EOS_TOKEN, load_tokenizer, train_tokenizer
from rltt.errors import RlttError

TEXTS = [r["question"] + "\n" + r["answer"] for r in generate(200, "medium", seed=0)]


@pytest.fixture(scope="module", params=["bpe", "char"])
def tokenizer(request):
    size = 400 if request.param == "bpe" else 64
    return train_tokenizer(TEXTS, vocab_size=size, kind=request.param)


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token == EOS_TOKEN
    ids = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert None not in ids and len(ids) == 3
    assert tokenizer.encode("Ann has 3 pens.", add_special_tokens=False)[-1] != tokenizer.eos_token_id


def test_round_trip_and_vocab_bound(tokenizer):
    for text in TEXTS[:20]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert len(tokenizer) <= (400 if len(tokenizer) > 64 else 64)


def test_bpe_compresses():
    bpe = train_tokenizer(TEXTS, vocab_size=512, kind="bpe")
    text = TEXTS[0]
    assert len(bpe.encode(text, add_special_tokens=False)) < len(text.encode()) / 2


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=60))
def test_bpe_round_trips_any_text(text):
    assert BPE.decode(BPE.encode(text, add_special_tokens=False)) == text


BPE = train_tokenizer(TEXTS, vocab_size=300, kind="bpe")


def test_char_unknown_characters():
    char = train_tokenizer(["abc abc"], vocab_size=32, kind="char")
    ids = char.encode("abz", add_special_tokens=False)
    assert len(ids) == 3 and ids[2] == char.unk_token_id


def test_save_and_load(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    for loaded in (AutoTokenizer.from_pretrained(str(tmp_path)), load_tokenizer(tmp_path)):
        text = TEXTS[5]
        assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
        assert loaded.eos_token_id == tokenizer.eos_token_id
        assert loaded.pad_token_id == tokenizer.pad_token_id
        assert loaded.bos_token_id == tokenizer.bos_token_id


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_deterministic(kind):
    a = train_tokenizer(iter(TEXTS), vocab_size=350, kind=kind)
    b = train_tokenizer(iter(TEXTS), vocab_size=350, kind=kind)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_errors(tmp_path):
    with pytest.raises(RlttError, match="kind"):
        train_tokenizer(TEXTS, kind="wordpiece")
    with pytest.raises(RlttError, match="vocab_size"):
        train_tokenizer(TEXTS, vocab_size=100, kind="bpe")
    with pytest.raises(RlttError, match="no tokenizer"):
        load_tokenizer(tmp_path)
