"""GSM8K: loading (JSONL, Parquet, or the Hugging Face hub), answers and prompts.

Records are dicts ``{"id", "question", "answer"}``; ``answer`` is the worked solution ending
in ``#### N`` (GSM8K's own format). Records from files without an ``id`` get
``"<file stem>-<line>"`` (JSONL, 1-based line) or ``"<file stem>-<row>"`` (Parquet, 0-based row).
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Iterator

from rltt.data import math_sets
from rltt.errors import RlttError

DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"
HUB_ID = "openai/gsm8k"
HUB_CONFIG = "main"
HUB_CONFIGS: dict[str, str] = {HUB_ID: HUB_CONFIG}
"""Hub sets that load a named config; any other hub id (MATH-500, AIME sets, …) loads its default."""

# A number as written in GSM8K answers and model completions: optional sign and "$",
# thousands separators, decimals ("-$1,234.50", "$-3", ".5").
_NUMBER_RE = re.compile(r"-?\$?-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
_FINAL_RE = re.compile(r"####[ \t]*(" + _NUMBER_RE.pattern + r")")
_FINAL_LINE_RE = re.compile(r"^[ \t]*####[ \t]*(" + _NUMBER_RE.pattern + r")[ \t]*\.?[ \t]*$", re.MULTILINE)


def normalize_number(text: str) -> str | None:
    """``"-$1,234.50"`` -> ``"-1234.50"``; ``None`` if ``text`` is not a single number."""
    cleaned = text.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    negative = cleaned.startswith("-")
    cleaned = cleaned[1:] if negative else cleaned
    if not re.fullmatch(r"\d+(?:\.\d+)?|\.\d+", cleaned):
        return None
    return ("-" if negative else "") + cleaned


def to_decimal(text: str) -> Decimal | None:
    """The numeric value of a number string (commas, ``$`` and signs handled), or ``None``."""
    normalized = normalize_number(text)
    if normalized is None:
        return None
    try:
        return Decimal(normalized)
    except InvalidOperation:  # pragma: no cover - the pattern above admits only valid decimals
        return None


def extract_final_answer(text: str) -> str | None:
    """The number after the last ``####`` in ``text``, normalized (``"1,234"`` -> ``"1234"``).

    ``None`` when there is no ``####`` followed by a number.
    """
    matches = _FINAL_RE.findall(text)
    return normalize_number(matches[-1]) if matches else None


def has_final_answer_line(text: str) -> bool:
    """Whether ``text`` has a line that is exactly ``#### <number>`` (a trailing period allowed)."""
    return _FINAL_LINE_RE.search(text) is not None


def extract_last_number(text: str) -> str | None:
    """The last number anywhere in ``text``, normalized; ``None`` if there is none."""
    matches = _NUMBER_RE.findall(text)
    return normalize_number(matches[-1]) if matches else None


def reference_answer(answer: str) -> str | None:
    """The reference number from a GSM8K ``answer`` (the ``#### N`` line) or a bare number."""
    final = extract_final_answer(answer)
    return final if final is not None else normalize_number(answer)


def format_prompt(question: str, template: str = DEFAULT_TEMPLATE) -> str:
    """The prompt for ``question``: ``template`` with ``{question}`` replaced.

    Other braces in the template are left alone (no ``str.format``), so templates may hold
    literal ``{`` and ``}``.
    """
    if "{question}" not in template:
        raise RlttError(f"prompt template must contain '{{question}}': {template!r}")
    return template.replace("{question}", question)


def _check_record(record: object, where: str) -> dict:
    if not isinstance(record, dict):
        raise RlttError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "question" not in record:  # a MATH / MATH-500 / AIME layout (`rltt.data.math_sets.LAYOUTS`)?
        record = math_sets.to_record(record, where) or record
    for key in ("question", "answer"):
        if not isinstance(record.get(key), str):
            raise RlttError(f"{where}: missing or non-string field '{key}'")
    return record


def read_jsonl(path: Path) -> Iterator[tuple[str, int, object]]:
    """``(where, line number, value)`` of each non-blank line of a JSONL file, read as it is
    consumed (``where``: ``path:line``); a line that is not UTF-8 or not JSON is a one-line
    `RlttError` naming it."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RlttError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RlttError(f"{where}: malformed JSON ({exc.msg})") from None
            yield where, lineno, value


def load_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    """GSM8K records from a JSONL file (one ``{"question", "answer"}`` object a line)."""
    path = Path(path)
    if not path.is_file():
        raise RlttError(f"GSM8K file not found: {path}")
    records: list[dict] = []
    if limit is not None and limit <= 0:
        return records
    for where, lineno, value in read_jsonl(path):  # lines past the limit are never read
        record = dict(_check_record(value, where))
        record.setdefault("id", f"{path.stem}-{lineno}")
        records.append(record)
        if limit is not None and len(records) >= limit:
            break
    return records


def load_parquet(path: str | Path, limit: int | None = None) -> list[dict]:
    """GSM8K records from a Parquet file with ``question`` and ``answer`` columns."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise RlttError(f"GSM8K file not found: {path}")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise RlttError(f"{path}: not a readable Parquet file ({exc})") from None
    missing = {"question", "answer"} - set(table.column_names)
    if missing and not math_sets.QUESTION_FIELDS & set(table.column_names):  # MATH-style: checked per row
        raise RlttError(f"{path}: missing column(s) {sorted(missing)} (has {table.column_names})")
    if limit is not None:
        table = table.slice(0, limit)
    records = []
    for row, record in enumerate(table.to_pylist()):
        record = dict(_check_record(record, f"{path}: row {row}"))
        if record.get("id") is None:
            record["id"] = f"{path.stem}-{row}"
        records.append(record)
    return records


def load_hub(name: str = HUB_ID, split: str = "train", config: str | None = None,
             limit: int | None = None) -> list[dict]:
    """GSM8K (or MATH-style) records through ``datasets.load_dataset(name, config, split=split)``;
    ``config`` None: the set's entry in `HUB_CONFIGS`, else its default config."""
    config = config if config is not None else HUB_CONFIGS.get(name)
    try:
        import datasets
    except ImportError:
        raise RlttError(
            f"loading '{name}' from the hub needs the 'datasets' package (pip install 'rltt[data]')"
        ) from None
    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RlttError(
            f"could not load dataset '{name}' (config '{config}', split '{split}'): {first_line}; "
            "offline? pass a local JSONL/Parquet path instead"
        ) from None
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    records = []
    for row, record in enumerate(dataset):
        record = dict(_check_record(record, f"{name}[{split}] row {row}"))
        if record.get("id") is None:
            record["id"] = f"{split}-{row}"
        records.append(record)
    return records


def _looks_like_hub_id(source: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", source)) and not source.endswith(
        (".jsonl", ".json", ".parquet")
    )


def load_gsm8k(source: str | Path, split: str = "train", limit: int | None = None,
               config: str | None = None) -> list[dict]:
    """GSM8K records from a file, a directory, or a hub id (MATH-style layouts too: `rltt.data.math_sets`).

    - a ``.jsonl``/``.json`` or ``.parquet`` file: that file (``split`` is ignored);
    - a directory: ``{split}.jsonl``, ``{split}.parquet`` or ``{split}-*.parquet`` inside it
      (e.g. ``rltt.data.GSM8K_SAMPLE_DIR``);
    - ``openai/gsm8k`` or another hub id that is not a local path: ``datasets.load_dataset``.
    """
    path = Path(source)
    if path.is_dir():
        for candidate in (path / f"{split}.jsonl", path / f"{split}.parquet"):
            if candidate.is_file():
                return load_gsm8k(candidate, split, limit)
        shards = sorted(path.glob(f"{split}-*.parquet"))
        if shards:
            records: list[dict] = []
            for shard in shards:
                records.extend(load_parquet(shard, None if limit is None else limit - len(records)))
                if limit is not None and len(records) >= limit:
                    break
            return records
        raise RlttError(f"no {split}.jsonl or {split}.parquet in GSM8K directory {path}")
    if path.suffix == ".parquet":
        return load_parquet(path, limit)
    if path.suffix in (".jsonl", ".json") or path.exists():
        return load_jsonl(path, limit)
    if isinstance(source, str) and _looks_like_hub_id(source):
        return load_hub(source, split=split, config=config, limit=limit)
    raise RlttError(f"GSM8K source not found: {source}")
