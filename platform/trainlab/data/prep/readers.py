"""Reading the records of one raw file, in file order, without ever raising on
bad content: every record comes back as text or as the reason it is unusable.

Formats: `text` (the whole file is one document), `jsonl` (one JSON object per
line, the text in `text_field`; blank lines are not records), `parquet` (the
text in column `text_field`). A file with no records at all counts as one
`empty` record, and a file that cannot be read at all as one `unreadable`
record, so neither disappears from the accounting.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from trainlab.data.prep.cleaning import decode_utf8
from trainlab.data.prep.paths import open_bytes
from trainlab.location import locate


@dataclass(frozen=True)
class RawRecord:
    location: str  # "path" (text), "path:LINE" (jsonl, 1-based), "path:row=N" (parquet, 0-based)
    text: str | None
    reason: str | None = None


def read_records(location: str, fmt: str, text_field: str | None) -> Iterator[RawRecord]:
    if fmt == "text":
        yield from _read_text(location)
    elif fmt == "jsonl":
        yield from _read_jsonl(location, text_field or "")
    elif fmt == "parquet":
        yield from _read_parquet(location, text_field or "")
    else:
        raise ValueError(f"unknown format {fmt!r}")


def _unreadable(location: str, err: Exception) -> RawRecord:
    return RawRecord(f"{location} ({type(err).__name__}: {err})"[:300], None, "unreadable")


def _read_text(location: str) -> Iterator[RawRecord]:
    try:
        data = open_bytes(location)
    except OSError as e:
        yield _unreadable(location, e)
        return
    text = decode_utf8(data)
    yield RawRecord(location, text, None if text is not None else "bad_encoding")


def _read_jsonl(location: str, field: str) -> Iterator[RawRecord]:
    try:
        data = open_bytes(location)
    except OSError as e:
        yield _unreadable(location, e)
        return
    any_record = False
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        any_record = True
        yield _jsonl_record(f"{location}:{lineno}", line, field)
    if not any_record:
        yield RawRecord(location, None, "empty")


def _jsonl_record(where: str, line: bytes, field: str) -> RawRecord:
    text = decode_utf8(line)
    if text is None:
        return RawRecord(where, None, "bad_encoding")
    try:
        obj = json.loads(text)
    except ValueError:
        return RawRecord(where, None, "malformed_record")
    if not isinstance(obj, dict):
        return RawRecord(where, None, "malformed_record")
    value = obj.get(field)
    if value is None:
        return RawRecord(where, None, "missing_field")
    if not isinstance(value, str):
        return RawRecord(where, None, "malformed_record")
    return RawRecord(where, value)


def _open_parquet(location: str):  # noqa: ANN202 - pyarrow.parquet.ParquetFile
    import pyarrow.parquet as pq

    return pq.ParquetFile(locate(location, what="source file").open_input_file())


def _read_parquet(location: str, field: str) -> Iterator[RawRecord]:
    import pyarrow as pa

    try:
        pf = _open_parquet(location)
        num_rows = pf.metadata.num_rows
        names = pf.schema_arrow.names
    except (OSError, pa.ArrowException) as e:
        yield _unreadable(location, e)
        return
    if num_rows == 0:
        yield RawRecord(location, None, "empty")
        return
    if field not in names:
        for row in range(num_rows):
            yield RawRecord(f"{location}:row={row}", None, "missing_field")
        return
    kind = _column_kind(pf.schema_arrow.field(field).type)
    row = 0
    try:
        for batch in pf.iter_batches(columns=[field], batch_size=4096):
            for value in batch.column(0).to_pylist():
                yield _parquet_record(f"{location}:row={row}", value, kind)
                row += 1
    except (OSError, pa.ArrowException) as e:
        # A file broken midway: the rows not yet read are counted as one unreadable record.
        yield _unreadable(f"{location}:row={row}", e)


def _column_kind(arrow_type) -> str:  # noqa: ANN001 - pyarrow.DataType
    import pyarrow as pa

    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "string"
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return "binary"
    return "other"


def _parquet_record(where: str, value: object, kind: str) -> RawRecord:
    if value is None:
        return RawRecord(where, None, "missing_field")
    if kind == "string":
        return RawRecord(where, value)  # type: ignore[arg-type]
    if kind == "binary":
        text = decode_utf8(value)  # type: ignore[arg-type]
        return RawRecord(where, text, None if text is not None else "bad_encoding")
    return RawRecord(where, None, "malformed_record")
