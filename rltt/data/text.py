"""Text for LM pretraining: document sources and resumable packing into fixed-length blocks.

A *document source* is indexable: ``source.num_documents`` (``None`` for an endless one)
and ``source.document(i)`` the text of document ``i``. Sources:

- ``ListSource``: texts in memory; ``load_documents(path)`` builds one from JSONL (a ``text``
  field, or ``question`` + ``answer`` through the prompt template) or Parquet (same columns);
- ``SyntheticSource``: the synthetic GSM8K-format generator, endless, document ``i`` made
  on demand from ``(seed, i)``.

``open_text_source(spec)`` picks one from a string: a file path, or ``synthetic`` /
``synthetic:PRESET``.

``BlockPacker`` tokenizes documents in order (a per-epoch shuffle optional), appends
``eos`` after each, concatenates them and cuts the stream into blocks of ``block_size``
token ids. Its ``state_dict()`` is the exact stream position (epoch, document, token offset),
so ``load_state_dict`` on a new packer continues with the very next block.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Protocol, Sequence

from rltt.data.gsm8k import DEFAULT_TEMPLATE, format_prompt, read_jsonl
from rltt.data.synthetic import Difficulty, generate_problem, resolve_difficulty
from rltt.errors import RlttError


def record_text(record: Mapping, template: str = DEFAULT_TEMPLATE, where: str = "record") -> str:
    """A document's text: its ``text`` field, or the prompt for ``question`` then ``answer``.

    Question/answer records become ``format_prompt(question, template) + " " + answer`` —
    the same prompt the RL stages use, so pretraining already sees the task's format.
    """
    if isinstance(record.get("text"), str):
        return record["text"]
    if isinstance(record.get("question"), str) and isinstance(record.get("answer"), str):
        return format_prompt(record["question"], template) + " " + record["answer"]
    raise RlttError(f"{where}: needs a 'text' field or 'question' and 'answer' fields")


class DocumentSource(Protocol):
    """Random access to documents by index."""

    @property
    def num_documents(self) -> int | None: ...  # pragma: no cover

    def document(self, index: int) -> str: ...  # pragma: no cover


@dataclass
class ListSource:
    """Documents held in memory."""

    texts: Sequence[str]

    @property
    def num_documents(self) -> int:
        return len(self.texts)

    def document(self, index: int) -> str:
        return self.texts[index]


@dataclass
class SyntheticSource:
    """The endless synthetic problem stream as documents (prompt + worked solution)."""

    difficulty: Difficulty | str | Mapping = "quickstart"
    seed: int = 0
    template: str = DEFAULT_TEMPLATE

    def __post_init__(self) -> None:
        self.difficulty = resolve_difficulty(self.difficulty)

    @property
    def num_documents(self) -> None:
        return None

    def document(self, index: int) -> str:
        return record_text(generate_problem(index, self.difficulty, self.seed).to_record(), self.template)


def load_documents(path: str | Path, template: str = DEFAULT_TEMPLATE) -> ListSource:
    """All documents of a local ``.jsonl`` (or ``.json`` lines) or ``.parquet`` file."""
    path = Path(path)
    if not path.is_file():
        raise RlttError(f"text data file not found: {path}")
    texts: list[str] = []
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:
            raise RlttError(f"{path}: not a readable Parquet file ({exc})") from None
        for row, record in enumerate(rows):
            texts.append(record_text(record, template, f"{path}: row {row}"))
    else:
        for where, _, record in read_jsonl(path):
            if not isinstance(record, dict):
                raise RlttError(f"{where}: expected a JSON object")
            texts.append(record_text(record, template, where))
    if not texts:
        raise RlttError(f"text data file has no documents: {path}")
    return ListSource(texts)


def open_text_source(spec: str | Path, template: str = DEFAULT_TEMPLATE, seed: int = 0) -> DocumentSource:
    """A source from a spec: a ``.jsonl``/``.parquet`` path, ``synthetic`` or ``synthetic:PRESET``."""
    text = str(spec)
    if text == "synthetic" or text.startswith("synthetic:"):
        preset = text.partition(":")[2] or "quickstart"
        return SyntheticSource(preset, seed=seed, template=template)
    return load_documents(spec, template)


@dataclass
class PackerState:
    """Where the block stream stands: the next block starts at token ``offset`` of the
    document at ``position`` in epoch ``epoch``'s order (document token lists include eos)."""

    epoch: int = 0
    position: int = 0
    offset: int = 0
    blocks: int = 0  # blocks emitted so far
    block_size: int = 0
    seed: int = 0
    shuffle: bool = False


@dataclass
class BlockPacker:
    """Pack tokenized documents into blocks of ``block_size`` token ids, resumably.

    ``encode`` maps a text to token ids (e.g. ``lambda t: tok.encode(t, add_special_tokens=False)``);
    ``eos_id`` is appended after every document. A finite source is repeated epoch after
    epoch (order reshuffled each epoch when ``shuffle``) unless ``repeat=False``, in which
    case iteration stops and the last partial block is dropped.
    """

    source: DocumentSource
    encode: Callable[[str], list[int]]
    eos_id: int
    block_size: int
    shuffle: bool = False
    seed: int = 0
    repeat: bool = True
    state: PackerState = field(init=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise RlttError(f"block_size must be >= 1, got {self.block_size}")
        n = self.source.num_documents
        if n is not None and n == 0:
            raise RlttError("text source has no documents")
        self.state = PackerState(block_size=self.block_size, seed=self.seed, shuffle=self.shuffle)
        self._order_cache: tuple[int, list[int]] | None = None

    @classmethod
    def from_tokenizer(cls, source: DocumentSource, tokenizer, block_size: int, **kwargs) -> "BlockPacker":
        """A packer using a transformers tokenizer's ``encode`` (no special tokens) and eos."""
        if tokenizer.eos_token_id is None:
            raise RlttError("tokenizer has no eos token; packing needs one between documents")
        return cls(
            source,
            lambda text: tokenizer.encode(text, add_special_tokens=False),
            tokenizer.eos_token_id,
            block_size,
            **kwargs,
        )

    # -- position bookkeeping -------------------------------------------------------------
    def _doc_index(self, epoch: int, position: int) -> int:
        n = self.source.num_documents
        if n is None or not self.shuffle:
            return position
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = list(range(n))
            random.Random(f"rltt-pack:{self.seed}:{epoch}").shuffle(order)
            self._order_cache = (epoch, order)
        return self._order_cache[1][position]

    def _tokens(self, epoch: int, position: int) -> list[int]:
        return list(self.encode(self.source.document(self._doc_index(epoch, position)))) + [self.eos_id]

    def _advance(self, epoch: int, position: int) -> tuple[int, int] | None:
        """The (epoch, position) after this document, or None when a non-repeating source ends."""
        n = self.source.num_documents
        position += 1
        if n is not None and position >= n:
            if not self.repeat:
                return None
            epoch, position = epoch + 1, 0
        return epoch, position

    # -- the stream -----------------------------------------------------------------------
    def next_block(self) -> list[int] | None:
        """The next block of ``block_size`` ids, or ``None`` when a non-repeating source is spent."""
        s = self.state
        epoch, position, offset = s.epoch, s.position, s.offset
        n = self.source.num_documents
        if n is not None and position >= n:  # already past the end of a non-repeating source
            return None
        block: list[int] = []
        while True:
            tokens = self._tokens(epoch, position)
            take = tokens[offset : offset + self.block_size - len(block)]
            block.extend(take)
            offset += len(take)
            if offset >= len(tokens):  # document used up: move to the next one
                nxt = self._advance(epoch, position)
                if nxt is None:
                    s.epoch, s.position, s.offset = epoch, n, 0  # mark spent
                    return None
                (epoch, position), offset = nxt, 0
            if len(block) == self.block_size:
                s.epoch, s.position, s.offset = epoch, position, offset
                s.blocks += 1
                return block

    def __iter__(self) -> Iterator[list[int]]:
        while (block := self.next_block()) is not None:
            yield block

    def batch(self, batch_size: int):
        """The next ``batch_size`` blocks as a ``torch.LongTensor [batch_size, block_size]``
        (``None`` if the source runs out first)."""
        import torch

        blocks = []
        for _ in range(batch_size):
            block = self.next_block()
            if block is None:
                return None
            blocks.append(block)
        return torch.tensor(blocks, dtype=torch.long)

    # -- resume ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The stream position as plain values (JSON-serializable)."""
        return dict(vars(self.state))

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from ``state`` (from ``state_dict()`` of a packer over the same data)."""
        for key in ("block_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise RlttError(
                    f"packer state mismatch: {key}={state[key]!r} in the saved state, {getattr(self, key)!r} now"
                )
        unknown = set(state) - set(PackerState.__dataclass_fields__)
        if unknown:
            raise RlttError(f"packer state has unknown key(s) {sorted(unknown)}")
        fresh = PackerState(block_size=self.block_size, seed=self.seed, shuffle=self.shuffle)
        self.state = PackerState(**{**vars(fresh), **state})
