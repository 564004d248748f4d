"""Work units and their per-unit work: read -> clean -> hash -> tokenize.

A unit is a run of consecutive files of one source (in dedup order). Units are
what Ray Data schedules and what a killed prep reuses: where they are cut
depends only on the files themselves (a cut after a file whose path hash says
so, about every `target_bytes`), so a changed or added file changes the units
around it, not every unit. Results never depend on where units are cut.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from trainlab.data.prep.cleaning import clean_text, content_id, hash_fraction
from trainlab.data.prep.paths import InputFile
from trainlab.data.prep.readers import read_records
from trainlab.data.prep.spec import CleaningSettings

# Columns of a unit's table after read -> clean -> hash (one row per raw record).
CLEANED_SCHEMA = pa.schema(
    [
        ("unit", pa.int64()),
        ("source", pa.string()),
        # The record's place: file (index among the unit's files), row (within the file).
        ("file", pa.int32()),
        ("row", pa.int64()),
        ("location", pa.string()),
        ("doc_id", pa.string()),
        ("text", pa.large_string()),
        ("reason", pa.string()),
        # CPU seconds the stage spent on this unit, on the unit's first row (0 elsewhere):
        # where the time goes, measured in the worker that did the work.
        ("cpu_read_clean", pa.float64()),
    ]
)
_CLEANED_NO_TEXT = CLEANED_SCHEMA.remove(CLEANED_SCHEMA.get_field_index("text"))


@dataclass(frozen=True)
class WorkUnit:
    index: int
    source: str
    format: str
    text_field: str | None
    min_chars: int
    max_chars: int
    files: tuple[str, ...]
    nbytes: int
    # Where it sits in dedup order: the source's position in the sources file and
    # the index of the unit's first file among the source's files.
    source_index: int = 0
    file_offset: int = 0
    # Identifies the unit's inputs (files by location, size, mtime); with the
    # settings, it names the unit's recorded result (see `work`).
    inputs: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str) -> WorkUnit:
        d = json.loads(s)
        return cls(**{**d, "files": tuple(d["files"])})


@dataclass(frozen=True)
class SourceFiles:
    """One source, ready to cut into units: its settings and its sorted files."""

    name: str
    format: str
    text_field: str | None
    cleaning: CleaningSettings
    files: list[InputFile]


def unit_target_bytes(total_bytes: int) -> int:
    """About 64 units for the corpus, between 256 KB and 16 MB each, rounded to a
    power of two: independent of the cluster's size (so a resumed run on another
    cluster reuses the same units) and unchanged by small changes of the corpus."""
    wanted = min(16 << 20, max(256 << 10, total_bytes // 64))
    return 1 << (int(wanted).bit_length() - 1)


def _cut_after(f: InputFile, target_bytes: int) -> bool:
    """A content-defined cut: decided by the file alone (its path's hash, weighted by
    its size), so units are about `target_bytes` and a changed file moves no cut
    but its own."""
    h = int.from_bytes(hashlib.blake2b(f.location.encode(), digest_size=8).digest(), "little")
    return h / 2**64 < f.size / max(1, target_bytes)


def plan_units(sources: Iterable[SourceFiles], target_bytes: int) -> list[WorkUnit]:
    """Cut every source's file list, in order, into units of about `target_bytes`
    (never above 4x: a hard cut then)."""
    units: list[WorkUnit] = []
    for source_index, src in enumerate(sources):
        batch: list[InputFile] = []
        size = offset = 0
        for f in src.files:
            batch.append(f)
            size += f.size
            if _cut_after(f, target_bytes) or size >= 4 * target_bytes:
                units.append(_unit(len(units), source_index, offset, src, batch))
                offset += len(batch)
                batch, size = [], 0
        if batch:
            units.append(_unit(len(units), source_index, offset, src, batch))
    return units


def _unit(
    index: int, source_index: int, offset: int, src: SourceFiles, files: list[InputFile]
) -> WorkUnit:
    inputs = json.dumps([[f.location, f.size, f.mtime_ns] for f in files])
    return WorkUnit(
        index,
        src.name,
        src.format,
        src.text_field,
        src.cleaning.min_chars,
        src.cleaning.max_chars,
        tuple(f.location for f in files),
        sum(f.size for f in files),
        source_index,
        offset,
        hashlib.sha256(inputs.encode()).hexdigest(),
    )


# --------------------------------------------------------------------------- read -> clean


def read_clean_unit(unit: WorkUnit) -> pa.Table:
    """Every raw record of the unit's files, cleaned and hashed, in file order."""
    table, texts = read_clean(unit)
    return table.add_column(
        CLEANED_SCHEMA.get_field_index("text"), "text", pa.array(texts, pa.large_string())
    )


def read_clean(unit: WorkUnit) -> tuple[pa.Table, list[str | None]]:
    """`read_clean_unit` without its text column, and the texts as a list beside it:
    the tokenizer takes Python strings, so the unit stage keeps them as such (a
    round trip through Arrow costs ~1 CPU-second per 100 MB of text)."""
    cpu_start = time.process_time()
    settings = CleaningSettings(min_chars=unit.min_chars, max_chars=unit.max_chars)
    files, rows, locations, doc_ids, texts, reasons = [], [], [], [], [], []
    for file_index, location in enumerate(unit.files):
        for row, rec in enumerate(read_records(location, unit.format, unit.text_field)):
            text, reason, doc_id = None, rec.reason, None
            if reason is None:
                cleaned, reason = clean_text(rec.text or "", settings)
                if reason is None:
                    doc_id = content_id(cleaned)
                    if doc_id is None:
                        reason = "bad_encoding"
                    else:
                        text = cleaned
            files.append(file_index)
            rows.append(row)
            locations.append(rec.location)
            doc_ids.append(doc_id)
            texts.append(text)
            reasons.append(reason)
    n = len(locations)
    table = pa.table(
        [
            pa.array([unit.index] * n, pa.int64()),
            pa.array([unit.source] * n),
            pa.array(files, pa.int32()),
            pa.array(rows, pa.int64()),
            pa.array(locations, pa.string()),
            pa.array(doc_ids, pa.string()),
            pa.array(reasons, pa.string()),
            _first_row(time.process_time() - cpu_start, n),
        ],
        schema=_CLEANED_NO_TEXT,
    )
    return table, texts


def _first_row(value: float, n: int) -> pa.Array:
    return pa.array(([value] + [0.0] * (n - 1)) if n else [], pa.float64())


# --------------------------------------------------------------------------- tokenizer sample


def sample_texts(table: pa.Table, fraction: float) -> pa.Table:
    """The kept documents whose hash falls below `fraction` (a deterministic sample,
    independent of order and of where units are cut)."""
    ids = table.column("doc_id").to_pylist()
    texts = table.column("text").to_pylist()
    picked = [
        (d, t)
        for d, t in zip(ids, texts, strict=True)
        if d is not None and hash_fraction(d) < fraction
    ]
    return pa.table(
        {
            "doc_id": pa.array([d for d, _ in picked], pa.string()),
            "text": pa.array([t for _, t in picked], pa.large_string()),
        }
    )


# --------------------------------------------------------------------------- tokenize


class ByRef:
    """A large stage argument passed through Ray's object store: a task fetches it
    when it needs it (an argument that large would be copied into every task's
    specification instead)."""

    def __init__(self, ref: object):
        self.refs = [ref]  # nested in a list, so Ray hands the ref over unresolved

    def get(self) -> object:
        import ray

        return ray.get(self.refs[0])


def resolve(value: object) -> object:
    return value.get() if isinstance(value, ByRef) else value


class TokenizeStage:
    """Tokenize the kept documents of a unit's table; EOS appended to each.

    Built once per worker process (`stages.unit_stage` keeps it). With `exact` dedup, later copies of a document within the same table are
    marked `duplicate` here and not tokenized; copies across units are found by
    the dedup shuffle (`dedup`).
    `threads=False` turns off the tokenizer's own thread pool, for when the
    workers already occupy every core.
    """

    def __init__(
        self,
        tokenizer_json: str | ByRef,
        eos_id: int,
        dtype: str,
        threads: bool = True,
        exact: bool = True,
    ):
        if not threads:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(resolve(tokenizer_json))  # type: ignore[arg-type]
        self.eos_id = eos_id
        self.dtype = np.dtype(dtype)
        self.exact = exact

    def __call__(self, table: pa.Table, texts: list[str | None]) -> pa.Table:
        """`table` and `texts`: a unit as `read_clean` gives it."""
        cpu_start = time.process_time()
        reasons = table.column("reason").to_pylist()
        doc_ids = table.column("doc_id").to_pylist()
        todo = _first_copies(doc_ids, reasons, self.exact)
        encodings = self.tokenizer.encode_batch_fast(
            [texts[i] for i in todo], add_special_tokens=False
        )
        ids = [e.ids for e in encodings]
        lengths = np.zeros(len(table), dtype=np.int64)
        lengths[todo] = [len(x) + 1 for x in ids]
        tokens = self._token_lists(ids, lengths)
        return pa.table(
            {
                "unit": table.column("unit"),
                "source": table.column("source"),
                "file": table.column("file"),
                "row": table.column("row"),
                "location": table.column("location"),
                "doc_id": table.column("doc_id"),
                "reason": pa.array(reasons, pa.string()),
                "tokens": tokens,
                "n_tokens": pa.array(lengths, pa.int64()),
                "cpu_read_clean": table.column("cpu_read_clean"),
                "cpu_tokenize": _first_row(time.process_time() - cpu_start, len(table)),
            }
        )

    def _token_lists(self, ids: list[list[int]], lengths: np.ndarray) -> pa.ListArray:
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.empty(int(offsets[-1]), dtype=self.dtype)
        ends = offsets[1:][lengths > 0]
        for end, doc in zip(ends, ids, strict=True):
            flat[end - 1 - len(doc) : end - 1] = doc
        flat[ends - 1] = self.eos_id
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))


def _first_copies(
    doc_ids: list[str | None], reasons: list[str | None], exact: bool = True
) -> list[int]:
    """Indices of kept rows to tokenize; with `exact`, marks later in-table copies
    as duplicates."""
    seen: set[str] = set()
    todo = []
    for i, (doc_id, reason) in enumerate(zip(doc_ids, reasons, strict=True)):
        if reason is not None or doc_id is None:
            continue
        if exact and doc_id in seen:
            reasons[i] = "duplicate"
        else:
            seen.add(doc_id)
            todo.append(i)
    return todo
