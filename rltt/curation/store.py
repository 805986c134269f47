"""The resumable record file of `rltt curate`: one JSON record per prompt, appended as it is scored.

`RecordJournal` is an append-only JSONL file. Each `append` writes whole lines and flushes them
to disk, so a killed run loses at most the line being written. Reading it back (`read`)
tolerates exactly that: a last line without its newline is an interrupted write, dropped (and
cut off the file before the next append). Anything else that is not a valid record — bad JSON
in the middle, a record another curation run wrote — is a one-line `RlttError` naming the file
and line, raised before the file is touched.

`read_parquet_records` reads a finished Parquet output the same way (naming the row), and
`write_jsonl_atomic` / `write_parquet_atomic` replace a file in one step (temp file + rename),
so a kill leaves either the old file or the new one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable

from rltt.errors import RlttError

#: ``check(record, where)`` raises an `RlttError` (naming ``where``) for a record that does not
#: belong in the file.
RecordCheck = Callable[[dict, str], None]


def refuse_record(where: str, why: str) -> RlttError:
    """The one-line error for a record that does not belong in an existing output file."""
    return RlttError(f"{where}: {why}; the file was left untouched (move it away or choose another --out)")


class RecordJournal:
    """An append-only JSONL file of records keyed by ``id``, safe to resume after a kill."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._complete_bytes: int | None = None  # length of the file's complete lines, once read

    def read(self, check: RecordCheck | None = None) -> list[dict]:
        """The complete records in file order (none when the file does not exist).

        A truncated last line (no trailing newline: the write a kill interrupted) is skipped;
        malformed JSON, a non-object, a record without a string ``id``, a duplicate id or a
        record ``check`` rejects raise an `RlttError` naming ``PATH:LINE``.
        """
        self._complete_bytes = 0
        if not self.path.exists():
            return []
        if not self.path.is_file():
            raise RlttError(f"{self.path}: not a file")
        data = self.path.read_bytes()
        records: list[dict] = []
        seen: set[str] = set()
        offset = 0
        for lineno, line in enumerate(data.splitlines(keepends=True), start=1):
            if not line.endswith(b"\n"):  # the last line, cut short by a kill: drop it
                break
            offset += len(line)
            if not line.strip():
                continue
            where = f"{self.path}:{lineno}"
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                raise refuse_record(where, f"not a curation record (malformed JSON: {reason})") from None
            _check_identity(record, where, seen)
            if check is not None:
                check(record, where)
            records.append(record)
        self._complete_bytes = offset
        return records

    def append(self, records: Iterable[dict]) -> None:
        """Append ``records`` (one JSON line each), flushed and synced before returning.

        The first append after `read` cuts off a truncated last line left by a killed run.
        """
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        if not lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._complete_bytes is not None and self.path.exists() \
                and self.path.stat().st_size > self._complete_bytes:
            with self.path.open("r+b") as f:
                f.truncate(self._complete_bytes)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(lines)
            f.flush()
            os.fsync(f.fileno())
        self._complete_bytes = self.path.stat().st_size

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        self._complete_bytes = 0


def _check_identity(record: object, where: str, seen: set[str]) -> None:
    if not isinstance(record, dict):
        raise refuse_record(where, f"not a curation record (a JSON {type(record).__name__}, not an object)")
    rid = record.get("id")
    if not isinstance(rid, str):
        raise refuse_record(where, "not a curation record (no string 'id')")
    if rid in seen:
        raise refuse_record(where, f"duplicate record id {rid!r}")
    seen.add(rid)


def read_parquet_records(path: str | Path, check: RecordCheck | None = None) -> list[dict]:
    """The records of a Parquet output, checked like `RecordJournal.read` (errors name the row)."""
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise refuse_record(str(path), f"not a readable Parquet file ({type(exc).__name__})") from None
    seen: set[str] = set()
    for row, record in enumerate(rows):
        where = f"{path}: row {row}"
        _check_identity(record, where, seen)
        if check is not None:
            check(record, where)
    return rows


def _temp_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_jsonl_atomic(path: str | Path, records: Iterable[dict]) -> Path:
    """Replace ``path`` with ``records`` as JSONL in one step (temp file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(path)
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_parquet_atomic(path: str | Path, records: list[dict], empty_columns: Iterable[str] = ()) -> Path:
    """Replace ``path`` with ``records`` as a Parquet table in one step; with no records, a table
    of string columns ``empty_columns`` (so readers still find them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(path)
    if records:
        table = pa.Table.from_pylist(records)
    else:
        table = pa.table({name: pa.array([], pa.string()) for name in empty_columns})
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path
