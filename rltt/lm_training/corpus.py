"""Text, tokenizer and batches for the LM stages.

- :func:`open_sources` gives the training and held-out document sources of a recipe's
  ``data`` section (synthetic generator, local JSONL/Parquet, or a ``datasets`` dataset);
- :func:`build_tokenizer` trains the tokenizer locally (or loads ``tokenizer.path``);
- :func:`held_out_batches` packs the held-out documents into fixed evaluation batches;
- :func:`eval_problems` are the held-out synthetic problems the solve rate is measured on.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

import torch

from rltt.data.synthetic import SyntheticProblem, generate_problem, resolve_difficulty
from rltt.data.text import BlockPacker, DocumentSource, ListSource, SyntheticSource, load_documents, record_text
from rltt.data.tokenizer import load_tokenizer, train_tokenizer
from rltt.errors import RlttError
from rltt.lm_training.stage_recipe import TextDataSection, TokenizerSection

#: offset added to ``data.seed`` for the held-out synthetic problems (disjoint from training)
HELD_OUT_SEED_OFFSET = 1


@dataclass
class Sources:
    """Training documents and held-out documents."""

    train: DocumentSource
    held_out: ListSource


def synthetic_difficulty(data: TextDataSection):
    """The `Difficulty` of a synthetic source (``difficulty`` beats the ``synthetic:PRESET``)."""
    if data.difficulty is not None:
        return resolve_difficulty(data.difficulty)
    return resolve_difficulty(data.source.partition(":")[2] or "quickstart")


def _hf_documents(data: TextDataSection) -> ListSource:
    try:
        import datasets
    except ImportError:
        raise RlttError("data.source hf:...: needs the 'datasets' package (pip install 'rltt[data]')") from None
    name = data.source[3:]
    try:
        dataset = datasets.load_dataset(name, data.hf_config, split=data.split)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RlttError(f"data.source: could not load dataset '{name}': {first}") from None
    texts = []
    for row, record in enumerate(dataset):
        if isinstance(record.get(data.text_field), str):
            texts.append(record[data.text_field])
        else:
            texts.append(record_text(record, data.prompt_template, f"{name} row {row}"))
    return ListSource(texts)


def open_sources(data: TextDataSection) -> Sources:
    """The training source and ``held_out_docs`` held-out documents for a ``data`` section."""
    if data.is_synthetic:
        difficulty = synthetic_difficulty(data)
        train = SyntheticSource(difficulty, seed=data.seed, template=data.prompt_template)
        held = SyntheticSource(difficulty, seed=data.seed + HELD_OUT_SEED_OFFSET, template=data.prompt_template)
        return Sources(train, ListSource([held.document(i) for i in range(data.held_out_docs)]))
    docs = _hf_documents(data) if data.source.startswith("hf:") else load_documents(data.source, data.prompt_template)
    texts = list(docs.texts)
    if len(texts) <= data.held_out_docs:
        raise RlttError(
            f"data.held_out_docs={data.held_out_docs} leaves no training documents ({data.source} has {len(texts)})"
        )
    return Sources(ListSource(texts[: -data.held_out_docs]), ListSource(texts[-data.held_out_docs :]))


def build_tokenizer(section: TokenizerSection, source: DocumentSource, block_size: int):
    """Load ``section.path`` or train a ``kind`` tokenizer on the first ``train_docs`` documents."""
    if section.path is not None:
        return load_tokenizer(section.path)
    n = source.num_documents
    count = section.train_docs if n is None else min(section.train_docs, n)
    texts = (source.document(i) for i in range(count))
    return train_tokenizer(texts, vocab_size=section.vocab_size, kind=section.kind,
                           model_max_length=max(block_size, 2048))


def train_packer(sources: Sources, tokenizer, data: TextDataSection) -> BlockPacker:
    """The resumable packer over the training documents."""
    return BlockPacker.from_tokenizer(sources.train, tokenizer, data.block_size,
                                      shuffle=data.shuffle, seed=data.seed)


def held_out_batches(sources: Sources, tokenizer, data: TextDataSection, batch_size: int,
                     num_batches: int) -> list[torch.Tensor]:
    """Up to ``num_batches`` fixed (batch_size, block_size) batches of held-out text."""
    packer = BlockPacker.from_tokenizer(sources.held_out, tokenizer, data.block_size, repeat=False)
    blocks = list(islice(iter(packer), batch_size * num_batches))
    batches = [torch.tensor(blocks[i : i + batch_size]) for i in range(0, len(blocks), batch_size)]
    if num_batches and not batches:
        raise RlttError(
            f"data.held_out_docs={data.held_out_docs} documents do not fill one block of {data.block_size} tokens"
        )
    return batches


def eval_problems(data: TextDataSection, count: int) -> list[SyntheticProblem]:
    """``count`` held-out synthetic problems (seed ``data.seed + 1``) for the solve rate."""
    difficulty = synthetic_difficulty(data)
    seed = data.seed + HELD_OUT_SEED_OFFSET
    return [generate_problem(i, difficulty, seed) for i in range(count)]
