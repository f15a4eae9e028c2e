"""Stream input files as bounded chunks of raw documents for the tokenising workers.

The main process only splits files into chunks (cheap, sequential I/O); decoding, JSON parsing and validation
happen in the workers (``encode_worker``), so one slow step never serialises the pipeline. Each chunk carries
the file name and the line (or row) number of every document so a bad record can be reported exactly.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

from llama_megatron.errors import DataError

FORMATS = ("jsonl", "text", "parquet", "hf")
TEXT_UNITS = ("line", "paragraph", "document")


@dataclass
class Chunk:
    """A batch of raw documents from one file.

    kind "jsonl": ``items`` are raw JSON lines (bytes); "text": raw documents (bytes, not yet decoded);
    "table": ``columns`` maps each key to a list of values. ``locations`` holds a 1-based line number (jsonl,
    text) or a 0-based row index (table) per document.
    """

    kind: str
    file: str
    locations: list[int]
    items: list[bytes] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)
    nbytes: int = 0
    rejected: list[str] = field(default_factory=list)  # "file:line: why" of lines refused while reading


def detect_format(path: str) -> str:
    if os.path.isdir(path):
        return "hf"
    name = path[:-3] if path.endswith(".gz") else path
    ext = os.path.splitext(name)[1].lower()
    if ext in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if ext == ".parquet":
        return "parquet"
    if ext in (".txt", ".text", ".md"):
        return "text"
    raise DataError(f"cannot tell the format of {path}; pass --input-format ({', '.join(FORMATS)})")


def _open_binary(path: str) -> IO[bytes]:
    try:
        return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    except OSError as exc:
        raise DataError(f"cannot open {path}: {exc.strerror}") from None


# The longest record read: a JSONL line, a text line or paragraph, a text file read as one document. A record is a
# document or a conversation, far below this; a longer one (a file that is not JSONL, a corrupt one without
# newlines) is a bad record, read past in bounded pieces, never held whole.
MAX_LINE_BYTES = 1 << 26


def _lines(f: IO[bytes]) -> Iterator[bytes | None]:
    """The file's lines, None for one longer than :data:`MAX_LINE_BYTES`."""
    limit = MAX_LINE_BYTES
    while raw := f.readline(limit + 1):
        if len(raw) <= limit:
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):  # the rest of the overlong line
            raw = f.readline(limit)
        yield None


def _chunked(path: str, kind: str, documents: Iterator[tuple[int, bytes | None]], what: str,
             chunk_bytes: int) -> Iterator[Chunk]:
    """Chunks of ``documents`` ((line, raw document) pairs; None for one over the bound: a rejection)."""
    chunk = Chunk(kind, path, [])
    for lineno, doc in documents:
        if doc is None:
            chunk.rejected.append(f"{path}:{lineno}: {what} longer than {MAX_LINE_BYTES} bytes")
            continue
        chunk.items.append(doc)
        chunk.locations.append(lineno)
        chunk.nbytes += len(doc)
        if chunk.nbytes >= chunk_bytes:
            yield chunk
            chunk = Chunk(kind, path, [])
    if chunk.items or chunk.rejected:
        yield chunk


def iter_jsonl(path: str, chunk_bytes: int) -> Iterator[Chunk]:
    with _open_binary(path) as f:
        lines = ((n, raw) for n, raw in enumerate(_lines(f), start=1) if raw is None or raw.strip())
        yield from _chunked(path, "jsonl", lines, "line", chunk_bytes)


def _text_documents(f: IO[bytes], unit: str) -> Iterator[tuple[int, bytes | None]]:
    """(first line, document) of each non-blank line, blank-line separated paragraph, or the whole file; None for
    one longer than :data:`MAX_LINE_BYTES` (read past, never held whole: a paragraph stops growing once over)."""
    if unit == "document":
        doc = f.read(MAX_LINE_BYTES + 1)
        if len(doc) > MAX_LINE_BYTES:
            yield 1, None
        elif doc.strip():
            yield 1, doc.rstrip(b"\r\n")
        return
    para: list[bytes] | None = []  # None: the paragraph under way is over the bound
    start = size = 0
    for lineno, raw in enumerate(_lines(f), start=1):
        blank = raw is not None and not raw.strip()
        if unit == "line":
            if not blank:
                yield lineno, raw and raw.rstrip(b"\r\n")
        elif blank:
            if start:
                yield start, None if para is None else b"\n".join(para)
            para, start, size = [], 0, 0
        else:
            start = start or lineno
            if raw is None or size + len(raw) > MAX_LINE_BYTES:
                para = None
            elif para is not None:
                para.append(raw.rstrip(b"\r\n"))
                size += len(raw)
    if start:
        yield start, None if para is None else b"\n".join(para)


def iter_text(path: str, chunk_bytes: int, unit: str) -> Iterator[Chunk]:
    """Documents are lines, blank-line separated paragraphs, or the whole file (like HF's text loader)."""
    if unit not in TEXT_UNITS:
        raise DataError(f"unknown text unit {unit!r}; use one of {', '.join(TEXT_UNITS)}")
    with _open_binary(path) as f:
        yield from _chunked(path, "text", _text_documents(f, unit), unit, chunk_bytes)


def _iter_arrow_batches(batches, path: str, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
    row = 0
    chunk = Chunk("table", path, [], columns={k: [] for k in keys})
    for batch in batches:
        cols = {k: batch.column(k).to_pylist() for k in keys}
        n = batch.num_rows
        chunk.locations.extend(range(row, row + n))
        for k in keys:
            chunk.columns[k].extend(cols[k])
        chunk.nbytes += sum(len(v) for v in cols[keys[0]] if isinstance(v, str))
        row += n
        if chunk.nbytes >= chunk_bytes:
            yield chunk
            chunk = Chunk("table", path, [], columns={k: [] for k in keys})
    if chunk.locations:
        yield chunk


def _check_columns(names: list[str], keys: list[str], path: str) -> None:
    missing = [k for k in keys if k not in names]
    if missing:
        raise DataError(f"{path}: no column {', '.join(missing)} (columns: {', '.join(names)})")


def iter_parquet(path: str, keys: list[str], chunk_bytes: int) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError variants for unreadable files
        raise DataError(f"cannot read parquet file {path}: {exc}") from None
    _check_columns(pf.schema_arrow.names, keys, path)
    yield from _iter_arrow_batches(pf.iter_batches(batch_size=256, columns=keys), path, keys, chunk_bytes)


def load_hf_dataset(path: str, split: str):
    """A ``save_to_disk`` directory (Dataset or DatasetDict), or local data files through ``load_dataset``."""
    import datasets

    if os.path.isdir(path):
        try:
            ds = datasets.load_from_disk(path)
        except FileNotFoundError as exc:
            raise DataError(f"{path} is not a dataset saved with save_to_disk: {exc}") from None
    else:
        builder = {"jsonl": "json", "text": "text", "parquet": "parquet"}.get(detect_format(path), "json")
        ds = datasets.load_dataset(builder, data_files=path, split=None)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path} has no split {split!r} (splits: {', '.join(ds)}); pass --hf-split")
        ds = ds[split]
    return ds


def iter_hf(path: str, keys: list[str], chunk_bytes: int, split: str) -> Iterator[Chunk]:
    ds = load_hf_dataset(path, split)
    _check_columns(list(ds.column_names), keys, path)
    # Arrow-formatted slices honour any indices mapping (select/shuffle) and never build Python dicts.
    table = ds.select_columns(keys).with_format("arrow")
    batches = (table[i : i + 256] for i in range(0, len(ds), 256))
    yield from _iter_arrow_batches(batches, path, keys, chunk_bytes)


def iter_chunks(
    paths: list[str],
    fmt: str,
    keys: list[str],
    chunk_bytes: int,
    text_unit: str = "line",
    hf_split: str = "train",
) -> Iterator[Chunk]:
    for path in paths:
        kind = detect_format(path) if fmt == "auto" else fmt
        if kind != "hf" and not os.path.isfile(path):
            raise DataError(f"input not found: {path}")
        if kind == "jsonl":
            yield from iter_jsonl(path, chunk_bytes)
        elif kind == "text":
            yield from iter_text(path, chunk_bytes, text_unit)
        elif kind == "parquet":
            yield from iter_parquet(path, keys, chunk_bytes)
        elif kind == "hf":
            yield from iter_hf(path, keys, chunk_bytes, hf_split)
        else:
            raise DataError(f"unknown input format {kind!r}; use one of auto, {', '.join(FORMATS)}")


def decode_chunk(chunk: Chunk, keys: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Texts per key, and a "file:line: reason" string per rejected record (a record is kept for all keys or none).

    Runs in the worker processes: JSON parsing and UTF-8 decoding are as costly as tokenising short documents.
    """
    texts: dict[str, list[str]] = {k: [] for k in keys}
    bad: list[str] = []
    if chunk.kind == "text":
        key = keys[0]
        bad.extend(chunk.rejected)
        for raw, lineno in zip(chunk.items, chunk.locations):
            try:
                texts[key].append(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                bad.append(f"{chunk.file}:{lineno}: invalid UTF-8 ({exc.reason} at byte {exc.start})")
        return texts, bad
    if chunk.kind == "jsonl":
        records = [(f"{chunk.file}:{lineno}", record) for lineno, record in json_objects(chunk, bad)]
    else:
        records = [
            (f"{chunk.file}: row {row}", {k: chunk.columns[k][i] for k in keys})
            for i, row in enumerate(chunk.locations)
        ]
    for where, record in records:
        problem = _record_problem(record, keys)
        if problem:
            bad.append(f"{where}: {problem}")
            continue
        for k in keys:
            texts[k].append(record[k])
    return texts, bad


def json_objects(chunk: Chunk, bad: list[str]):
    """The JSONL chunk's lines as (line number, JSON object); a line that is not one adds ``file:line: why`` to
    ``bad`` instead."""
    import json

    bad.extend(chunk.rejected)
    for raw, lineno in zip(chunk.items, chunk.locations):
        try:
            record = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            bad.append(f"{chunk.file}:{lineno}: invalid JSON ({exc})")
            continue
        except RecursionError:  # "[[[[..." deeper than the parser's recursion limit
            bad.append(f"{chunk.file}:{lineno}: invalid JSON (nested too deeply)")
            continue
        if not isinstance(record, dict):
            bad.append(f"{chunk.file}:{lineno}: expected a JSON object, got {type(record).__name__}")
            continue
        yield lineno, record


def _record_problem(record: dict, keys: list[str]) -> str | None:
    for k in keys:
        if k not in record:
            return f"no key {k!r} (keys: {', '.join(map(str, record)) or 'none'})"
        if not isinstance(record[k], str):
            return f"key {k!r} is {type(record[k]).__name__}, not a string"
    return None
