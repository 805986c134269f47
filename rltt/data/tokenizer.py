"""Train a small tokenizer locally and wrap it as a transformers tokenizer.

Two kinds:

- ``"bpe"``: byte-level BPE (every byte is in the base vocabulary, so nothing is ever
  unknown; merges are learned up to ``vocab_size``);
- ``"char"``: one token per character, the ``vocab_size - specials`` most frequent characters
  of the training texts (ties broken by code point); other characters map to ``<|unk|>``.

Both come back as a ``PreTrainedTokenizerFast`` with bos/eos/pad (and unk) tokens, so they
save with ``save_pretrained(dir)`` and load with ``AutoTokenizer.from_pretrained(dir)``.
Encoding adds no special tokens by itself; callers append ``eos_token_id`` where they need it.
Training is deterministic: the same texts in the same order give the same tokenizer.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from rltt.errors import RlttError

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)  # ids 0..3 in this order

TOKENIZER_KINDS = ("bpe", "char")


def _train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise RlttError(
            f"tokenizer vocab_size must be >= {len(alphabet) + len(SPECIAL_TOKENS)} for byte-level BPE, got {vocab_size}"
        )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _train_char(texts: Iterable[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(text)
    room = vocab_size - len(SPECIAL_TOKENS)
    if room < 1:
        raise RlttError(f"tokenizer vocab_size must be > {len(SPECIAL_TOKENS)}, got {vocab_size}")
    chars = sorted(counts, key=lambda c: (-counts[c], ord(c)))[:room]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(chars):
        vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # every character (newlines included) is its own pre-token, hence its own token
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 512,
    kind: str = "bpe",
    min_frequency: int = 2,
    model_max_length: int = 2048,
):
    """Train a tokenizer on ``texts`` and return it as a ``PreTrainedTokenizerFast``.

    ``vocab_size`` is the total size, special tokens included (a maximum: a small corpus may
    give fewer tokens). ``kind`` is ``"bpe"`` (byte-level BPE, ``vocab_size >= 260``) or
    ``"char"``. ``min_frequency`` is the fewest occurrences of a pair BPE merges.
    """
    from transformers import PreTrainedTokenizerFast

    if kind == "bpe":
        backend = _train_bpe(texts, vocab_size, min_frequency)
    elif kind == "char":
        backend = _train_char(texts, vocab_size)
    else:
        raise RlttError(f"unknown tokenizer kind '{kind}' (choose from {', '.join(TOKENIZER_KINDS)})")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path):
    """A tokenizer saved with ``save_pretrained`` (``AutoTokenizer.from_pretrained(path)``)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    if not (Path(path) / "tokenizer.json").is_file() and not (Path(path) / "tokenizer_config.json").is_file():
        raise RlttError(f"no tokenizer in {path} (expected tokenizer.json)")
    return AutoTokenizer.from_pretrained(str(path))
