"""Packing: documents (with their EOS) into rows of `seq_len` tokens.

A source's stream is its documents, epoch after epoch, concatenated; unit k of
the source is stream tokens [k*L, (k+1)*L). A document longer than what is
left in a row continues in the source's next unit, keeping its positions.

Per token (contract 3): `position_ids` count within the document (0 at its
start, continuing after a split), `document_ids` number the pieces within the
row (0, 1, ...; -1 for padding), `labels` are the next token of the same piece
and -100 where there is none (a piece's last token, padding). Padding (EOS ids)
only fills the end of a finite stream (validation); training rows are full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from trainlab.data.corpus import SourceTokens
from trainlab.data.mix import epoch_order

IGNORE_INDEX = -100
Batch = dict[str, np.ndarray]
BATCH_KEYS = ("input_ids", "labels", "position_ids", "document_ids")


class Piece(NamedTuple):
    doc: int  # document index within the source
    start: int  # first token within the document
    length: int


class SourceStream:
    """One source's documents as an endless stream of epochs.

    `shuffle`: each epoch in its own order (`epoch_order`); otherwise `docs` in the
    given order every epoch (validation). `finite`: a single pass, no epoch 1."""

    def __init__(self, src: SourceTokens, docs: np.ndarray, seed: int, shuffle: bool,
                 finite: bool = False):
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
        cached = self._epochs.get(e if self.shuffle else 0)
        if cached is not None:
            return cached
        order = (self.docs[epoch_order(self.seed, self.src.name, e, len(self.docs))]
                 if self.shuffle else self.docs)
        starts = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(self.doc_lengths[order], out=starts[1:])
        if len(self._epochs) >= 3:  # a row touches at most a few epochs
            self._epochs.pop(next(iter(self._epochs)))
        self._epochs[e if self.shuffle else 0] = (order, starts)
        return order, starts

    def pieces(self, start: int, n: int) -> list[Piece]:
        """The document pieces covering stream tokens [start, start + n) (fewer tokens
        only at the end of a finite stream)."""
        out: list[Piece] = []
        pos, end = start, start + n
        while pos < end and self.epoch_tokens > 0:
            e, p = divmod(pos, self.epoch_tokens)
            if self.finite and e > 0:
                break
            order, starts = self.epoch(e)
            j = int(np.searchsorted(starts, p, side="right")) - 1
            while pos < end and j < len(order):
                off = p - int(starts[j])
                take = min(int(starts[j + 1]) - p, end - pos)
                out.append(Piece(int(order[j]), off, take))
                pos += take
                p += take
                j += 1
        return out

    def docs_started(self, tokens: int) -> int:
        """Documents whose first token lies in stream tokens [0, tokens)."""
        if self.epoch_tokens == 0:
            return 0
        full, rest = divmod(tokens, self.epoch_tokens)
        _, starts = self.epoch(full)
        return full * len(self.docs) + int(np.searchsorted(starts[:-1], rest, side="left"))


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


def fill_row(batch: Batch, row: int, src: SourceTokens, pieces: list[Piece]) -> tuple[int, bool]:
    """Write `pieces` into `row`; return (documents started, last piece is cut short)."""
    col, starts = 0, 0
    ids, labels = batch["input_ids"][row], batch["labels"][row]
    for d, (doc, start, n) in enumerate(pieces):
        first = int(src.offsets[doc]) + start
        ids[col:col + n] = src.tokens[first:first + n]
        labels[col:col + n - 1] = ids[col + 1:col + n]
        labels[col + n - 1] = IGNORE_INDEX
        batch["position_ids"][row, col:col + n] = np.arange(start, start + n)
        batch["document_ids"][row, col:col + n] = d
        starts += start == 0
        col += n
    split = bool(pieces) and pieces[-1].start + pieces[-1].length < int(
        src.offsets[pieces[-1].doc + 1] - src.offsets[pieces[-1].doc])
    return starts, split


def pack_units(streams: list[SourceStream], sources: np.ndarray, units: np.ndarray,
               seq_len: int, pad_id: int) -> PackedRows:
    """Row i = unit `units[i]` of source `sources[i]`."""
    rows = len(sources)
    batch = empty_batch(rows, seq_len, pad_id)
    doc_starts = np.zeros(rows, dtype=np.int64)
    split = np.zeros(rows, dtype=bool)
    for i, (s, k) in enumerate(zip(sources.tolist(), units.tolist(), strict=True)):
        stream = streams[s]
        doc_starts[i], split[i] = fill_row(batch, i, stream.src,
                                           stream.pieces(k * seq_len, seq_len))
    return PackedRows(batch, np.asarray(sources, np.int64), np.asarray(units, np.int64),
                      doc_starts, split)


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    return {k: v[start:stop] for k, v in batch.items()}
