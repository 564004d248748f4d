"""Packing: documents (with their EOS) into rows of `seq_len` tokens.

A source's stream is its documents, epoch after epoch, concatenated; unit k of
the source is stream tokens [k*L, (k+1)*L). A document longer than what is
left in a row continues in the source's next unit, keeping its positions.

Per token (contract 3): `position_ids` count within the document (0 at its
start, continuing after a split), `document_ids` number the pieces within the
row (0, 1, ...; -1 for padding), `labels` are the next token of the same piece
and -100 where there is none (a piece's last token, padding). Padding (EOS ids)
only fills the end of a finite stream (validation); training rows are full.

Everything is vectorized over pieces (a document's part within one row): the
Python work per batch is a few numpy calls per source and epoch, not per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainlab.data.corpus import SourceTokens
from trainlab.data.mix import epoch_order

IGNORE_INDEX = -100
Batch = dict[str, np.ndarray]
BATCH_KEYS = ("input_ids", "labels", "position_ids", "document_ids")


@dataclass
class Pieces:
    """Document pieces covering a stretch of a source's stream, in stream order."""

    at: np.ndarray  # int64 stream position of each piece's first token
    doc: np.ndarray  # int64 document index within the source
    start: np.ndarray  # int64 first token within the document (its position id)
    length: np.ndarray  # int64 tokens in the piece

    @staticmethod
    def concat(parts: list[Pieces]) -> Pieces:
        if not parts:
            z = np.zeros(0, np.int64)
            return Pieces(z, z, z, z)
        return Pieces(
            *(
                np.concatenate([getattr(p, f) for p in parts])
                for f in ("at", "doc", "start", "length")
            )
        )


class SourceStream:
    """One source's documents as an endless stream of epochs.

    `shuffle`: each epoch in its own order (`epoch_order`); otherwise `docs` in the
    given order every epoch (validation). `finite`: a single pass, no epoch 1."""

    def __init__(
        self, src: SourceTokens, docs: np.ndarray, seed: int, shuffle: bool, finite: bool = False
    ):
        self.src = src
        self.docs = np.asarray(docs, dtype=np.int64)
        self.seed = seed
        self.shuffle = shuffle
        self.finite = finite
        self.doc_lengths = src.lengths
        self.epoch_tokens = int(self.doc_lengths[self.docs].sum())
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(document indices in epoch order, their start offsets in the epoch + total)."""
        key = e if self.shuffle else 0
        cached = self._epochs.get(key)
        if cached is not None:
            return cached
        order = (
            self.docs[epoch_order(self.seed, self.src.name, e, len(self.docs))]
            if self.shuffle
            else self.docs
        )
        starts = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(self.doc_lengths[order], out=starts[1:])
        if len(self._epochs) >= 3:  # a batch touches at most a few epochs
            self._epochs.pop(next(iter(self._epochs)))
        self._epochs[key] = (order, starts)
        return order, starts

    def pieces(self, begin: int, end: int, cut_every: int) -> Pieces:
        """Pieces covering stream tokens [begin, end), cut at document boundaries and
        at multiples of `cut_every` (row boundaries). A finite stream stops early."""
        e_size = self.epoch_tokens
        if e_size == 0 or begin >= end:
            return Pieces.concat([])
        parts = []
        for e in range(begin // e_size, (end - 1) // e_size + 1):
            if self.finite and e > 0:
                break
            base = e * e_size
            lo, hi = max(begin, base) - base, min(end, base + e_size) - base
            order, starts = self.epoch(e)
            first_row_cut = -(-(base + lo + 1) // cut_every) * cut_every - base
            cuts = np.union1d(
                starts[(starts > lo) & (starts < hi)],
                np.arange(first_row_cut, hi, cut_every, dtype=np.int64),
            )
            at = np.concatenate([[lo], cuts]).astype(np.int64)
            length = np.diff(np.concatenate([at, [hi]]))
            j = np.searchsorted(starts, at, side="right") - 1
            parts.append(Pieces(at + base, order[j], at - starts[j], length))
        return Pieces.concat(parts)


@dataclass
class PackedRows:
    """Rows in the batch layout plus per-row bookkeeping the loader reports from."""

    batch: Batch
    row_source: np.ndarray  # int64 source index per row
    row_unit: np.ndarray  # int64 unit index within the source's stream
    row_doc_starts: np.ndarray  # int64 documents starting in the row
    row_split: np.ndarray  # bool: the row's last document continues in a later row


def empty_batch(rows: int, seq_len: int, pad_id: int) -> Batch:
    return {
        "input_ids": np.full((rows, seq_len), pad_id, dtype=np.int64),
        "labels": np.full((rows, seq_len), IGNORE_INDEX, dtype=np.int64),
        "position_ids": np.zeros((rows, seq_len), dtype=np.int64),
        "document_ids": np.full((rows, seq_len), -1, dtype=np.int32),
    }


def _consecutive_runs(units: np.ndarray) -> list[tuple[int, int]]:
    """[(first index, end index)) of runs where units go up by one."""
    breaks = np.flatnonzero(np.diff(units) != 1) + 1
    edges = np.concatenate([[0], breaks, [len(units)]])
    return list(zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True))


def _write_pieces(
    out: PackedRows, src: SourceTokens, p: Pieces, rows: np.ndarray, seq_len: int
) -> None:
    """Write pieces (in stream order, already mapped to output `rows`) into `out`."""
    if len(p.at) == 0:
        return
    col = p.at % seq_len
    # Index of each piece within its row: pieces arrive sorted by (row, col).
    first_in_row = np.searchsorted(rows, rows, side="left")
    doc_index = np.arange(len(rows)) - first_in_row
    piece = np.repeat(np.arange(len(rows)), p.length)
    within = np.arange(len(piece)) - np.repeat(np.cumsum(p.length) - p.length, p.length)
    token = np.repeat(src.offsets[p.doc] + p.start, p.length) + within
    flat = np.repeat(rows * seq_len + col, p.length) + within
    b = out.batch
    b["input_ids"].flat[flat] = src.tokens[token]
    b["position_ids"].flat[flat] = np.repeat(p.start, p.length) + within
    b["document_ids"].flat[flat] = np.repeat(doc_index, p.length)
    has_next = within < np.repeat(p.length, p.length) - 1
    b["labels"].flat[flat[has_next]] = src.tokens[token[has_next] + 1]
    np.add.at(out.row_doc_starts, rows[p.start == 0], 1)
    last_in_row = np.concatenate([rows[1:] != rows[:-1], [True]])
    doc_len = src.offsets[p.doc + 1] - src.offsets[p.doc]
    cut = (p.start + p.length < doc_len) & last_in_row
    out.row_split[rows[cut]] = True


def pack_units(
    streams: list[SourceStream], sources: np.ndarray, units: np.ndarray, seq_len: int, pad_id: int
) -> PackedRows:
    """Row i = unit `units[i]` of stream `sources[i]` (stream tokens
    [units[i]*L, (units[i]+1)*L)), padded where a finite stream ends."""
    sources = np.asarray(sources, np.int64)
    units = np.asarray(units, np.int64)
    n = len(sources)
    out = PackedRows(
        empty_batch(n, seq_len, pad_id), sources, units, np.zeros(n, np.int64), np.zeros(n, bool)
    )
    for s in np.unique(sources).tolist():
        out_rows = np.flatnonzero(sources == s)
        stream = streams[s]
        for a, b in _consecutive_runs(units[out_rows]):
            k0, k1 = int(units[out_rows[a]]), int(units[out_rows[b - 1]]) + 1
            p = stream.pieces(k0 * seq_len, k1 * seq_len, seq_len)
            rows = out_rows[a + (p.at // seq_len - k0)]
            _write_pieces(out, stream.src, p, rows, seq_len)
    return out


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    return {k: v[start:stop] for k, v in batch.items()}
