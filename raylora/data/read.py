"""Reading raw rows from JSON, JSONL, Parquet and CSV files, streaming, with their line numbers.

Each row is kept as its JSON text (``raw``) with its ``source`` file and ``line`` (the line of a
JSONL row or of the start of a JSON-array element; the 1-based row number in Parquet and CSV), so
a rejected row can always be traced back. Parsing happens later, per row, so one bad row never
sinks a file; a file whose structure is broken (a JSON array that stops parsing) fails at the
first offending line.
"""

from __future__ import annotations

import codecs
import glob
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")  # in any case: C.JSONL is read
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip")
CHUNK = 1 << 20
RawRow = tuple[int, str | None, str | None]  # (line, raw JSON text, error)


class UnreadableFile(ValueError):
    """A whole file cannot be read on (a ``.json`` array broken mid-file); the message names the file and line."""


def expand(path: str) -> list[str]:
    """Files named by a file path, a folder (its data files, sorted) or a glob.

    Raises:
        FileNotFoundError: nothing matches, naming the path and the extensions read.
        ValueError: a file named alone is not a data file, or a compressed data file (``.jsonl.gz``) is among them.
    """
    p = Path(path)
    if p.is_dir():
        found = sorted(str(f) for f in p.iterdir() if f.is_file())
    elif p.is_file():
        found = [str(p)]
    else:
        found = sorted(f for f in glob.glob(path) if Path(f).is_file())
    packed = [f for f in found if _suffix(f) in COMPRESSED and _suffix(f.removesuffix(Path(f).suffix)) in EXTENSIONS]
    if packed:
        raise ValueError(
            f"data.sources: {', '.join(packed)}: compressed data files are not read; decompress them "
            f"(gunzip, unzstd, ...) or name only the other files"
        )
    files = [f for f in found if _suffix(f) in EXTENSIONS]
    if p.is_file() and not files:
        raise ValueError(f"data.sources: {p} is not one of {', '.join(EXTENSIONS)}")
    if not files:
        raise FileNotFoundError(f"data.sources: {path} matches no data file (looked for {', '.join(EXTENSIONS)})")
    return [str(Path(f).resolve()) for f in files]


def _suffix(path: str) -> str:
    return Path(path).suffix.lower()


def iter_raw(f: BinaryIO, path: str) -> Iterator[RawRow]:
    """Rows of one file as ``(line, raw_json, error)``; exactly one of raw_json and error is set."""
    suffix = _suffix(path)
    if suffix == ".jsonl":
        yield from _jsonl(f)
    elif suffix == ".json":
        yield from _json(f, path)
    elif suffix == ".parquet":
        batches = pq.ParquetFile(f).iter_batches(batch_size=4096)
        yield from _records([_without_nulls(row) for row in b.to_pylist()] for b in batches)
    else:
        # Every column as text: a CSV file holds no types, and inferring them turned an answer "5" into the int 5,
        # which no format takes. Read as bytes and decoded per row, so a row that is not UTF-8 is rejected alone.
        names = pcsv.open_csv(f).schema.names
        f.seek(0)
        options = pcsv.ConvertOptions(column_types=dict.fromkeys(names, pa.binary()), strings_can_be_null=False,
                                      quoted_strings_can_be_null=False)  # fmt: skip
        yield from _csv_records(b.to_pylist() for b in pcsv.open_csv(f, convert_options=options))


def _jsonl(f: BinaryIO) -> Iterator[RawRow]:
    rest = b""
    line = 0
    while True:
        chunk = f.read(CHUNK)
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop() if chunk else b""
        for data in lines:
            line += 1
            if line == 1:
                data = data.removeprefix(codecs.BOM_UTF8)  # as editors on Windows save UTF-8
            if not data.strip():
                continue
            try:
                yield line, data.decode("utf-8"), None
            except UnicodeDecodeError as e:
                yield line, None, f"undecodable text (not UTF-8: {e.reason} at byte {e.start})"
        if not chunk:
            return


def _json(f: BinaryIO, path: str) -> Iterator[RawRow]:
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf, pos, line, eof = "", 0, 1, False

    def more() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        chunk = f.read(CHUNK)
        eof = not chunk
        try:
            buf = buf[pos:] + utf8.decode(chunk, final=eof)
        except UnicodeDecodeError as e:
            raise UnreadableFile(f"{path}: not UTF-8 near line {line} ({e.reason})") from None
        pos = 0
        return bool(chunk)

    def skip(chars: str) -> None:
        nonlocal pos, line
        while True:
            while pos < len(buf) and buf[pos] in chars:
                line += buf[pos] == "\n"
                pos += 1
            if pos < len(buf) or not more():
                return

    skip(" \t\r\n\ufeff")
    if pos >= len(buf) or buf[pos] != "[":
        raise UnreadableFile(
            f"{path}: a .json file must hold a JSON array of rows; line {line} starts with {buf[pos : pos + 40]!r}"
        )
    pos += 1
    while True:
        skip(" \t\r\n,")
        if pos >= len(buf):
            raise UnreadableFile(f"{path}: the JSON array is not closed (ends at line {line})")
        if buf[pos] == "]":
            return
        while True:
            try:
                _, end = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError:
                if not more():
                    _raise_at(decoder, buf, pos, line, path)
        yield line, buf[pos:end], None
        line += buf.count("\n", pos, end)
        pos = end


def _raise_at(decoder: json.JSONDecoder, buf: str, pos: int, line: int, path: str) -> None:
    try:
        decoder.raw_decode(buf, pos)
    except json.JSONDecodeError as e:  # located in the final buffer, whose start is ``line``
        raise UnreadableFile(
            f"{path}: not valid JSON at line {line + buf.count(chr(10), pos, e.pos)}: {e.msg}"
        ) from None


def _without_nulls(value: Any) -> Any:
    """``value`` without the object keys whose value is null, at any depth.

    A Parquet struct column has one schema for all rows, the union of their keys: a row's tool schema or call
    arguments gained every other row's keys as nulls, which then showed in the prompt and the learned text. Parquet
    cannot tell such a null from an absent key, so both read as absent.
    """
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _csv_records(batches: Iterator[list[dict[str, Any]]]) -> Iterator[RawRow]:
    line = 0
    for rows in batches:
        for row in rows:
            line += 1
            try:
                text = {k: v.decode("utf-8") for k, v in row.items()}
            except UnicodeDecodeError as e:
                yield line, None, f"undecodable text (not UTF-8: {e.reason})"
                continue
            yield line, json.dumps(text, ensure_ascii=False), None


def _records(batches: Iterator[list[dict[str, Any]]]) -> Iterator[RawRow]:
    line = 0
    for rows in batches:
        for row in rows:
            line += 1
            yield line, json.dumps(row, ensure_ascii=False, default=str), None


def first_row(path: str) -> tuple[int, Any]:
    """The first row of a file, parsed, for format checks before the pipeline starts.

    Raises:
        ValueError: the file is empty, or its first row is not valid JSON / not decodable.
    """
    with open(path, "rb") as f:
        for line, raw, error in iter_raw(f, path):
            if error:
                raise ValueError(f"{path}:{line}: {error}")
            try:
                return line, json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line}: not valid JSON ({e.msg}): {raw[:120]!r}") from None
    raise ValueError(f"{path}: holds no rows")


def iter_blocks(f: BinaryIO, path: str, max_rows: int | None, rows_per_block: int = 2048) -> Iterator[pa.Table]:
    """The first ``max_rows`` rows of a file as Arrow tables of ``{source, line, raw, error}``."""
    batch: list[RawRow] = []
    for row in itertools.islice(iter_raw(f, path), max_rows):
        batch.append(row)
        if len(batch) == rows_per_block:
            yield _table(path, batch)
            batch = []
    if batch:
        yield _table(path, batch)


def _table(path: str, rows: list[RawRow]) -> pa.Table:
    return pa.table(
        {
            "source": pa.array([path] * len(rows), pa.string()),
            "line": pa.array([r[0] for r in rows], pa.int64()),
            "raw": pa.array([r[1] for r in rows], pa.string()),
            "error": pa.array([r[2] for r in rows], pa.string()),
        }
    )
