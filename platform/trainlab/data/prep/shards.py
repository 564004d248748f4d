"""The writer: tokenized unit tables in, in dedup order; shards and accounts out.

It keeps the first copy of every document (by source order, then path, then
position: the order the tables arrive in), counts every record that does not
make it by reason, and cuts each source's documents into Parquet shards of
about `shard_target_bytes` of token ids. Where a shard ends depends only on
the documents, never on how the input was batched, so the same inputs always
give byte-identical shards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainlab.data.prep.cleaning import REASONS
from trainlab.fileutil import sha256_file

MAX_EXAMPLES = 5
SHARD_COLUMNS = ("doc_id", "source", "tokens", "n_tokens")
SHARD_NAME = "part-{:05d}.parquet"


@dataclass
class SourceAccount:
    """Where every record of one source went: `docs_in == docs_out + sum(rejected)`."""

    name: str
    docs_in: int = 0
    docs_out: int = 0
    tokens: int = 0
    rejected: dict[str, dict] = field(
        default_factory=lambda: {r: {"count": 0, "examples": []} for r in REASONS}
    )
    shards: list[dict] = field(default_factory=list)

    def reject(self, reason: str, location: str) -> None:
        entry = self.rejected[reason]
        entry["count"] += 1
        if len(entry["examples"]) < MAX_EXAMPLES:
            entry["examples"].append(location)

    def to_json(self) -> dict:
        return {
            "docs_in": self.docs_in,
            "docs_out": self.docs_out,
            "tokens": self.tokens,
            "rejected": self.rejected,
            "shards": self.shards,
        }


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write under a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_shard(path: Path, table: pa.Table) -> str:
    """Write one zstd Parquet shard atomically; return its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    # One chunk per column, so page boundaries (and so the bytes) never depend on
    # how the rows were batched on their way here.
    pq.write_table(table.combine_chunks(), tmp, compression="zstd")
    digest = sha256_file(tmp)
    os.replace(tmp, path)
    return digest


class DatasetWriter:
    def __init__(self, out_dir: Path, source_names: list[str], dtype: str, shard_target_bytes: int):
        self.out_dir = out_dir
        self.accounts = {name: SourceAccount(name) for name in source_names}
        self.itemsize = np.dtype(dtype).itemsize
        self.target = max(1, shard_target_bytes)
        self._seen: set[str] = set()
        self._source: str | None = None
        self._pending: list[pa.Table] = []
        self._pending_bytes = 0

    def add(self, table: pa.Table) -> None:
        """One tokenized table (rows in dedup order, following the previous table)."""
        sources = table.column("source").to_pylist()
        start = 0
        for i in range(1, len(sources) + 1):
            if i == len(sources) or sources[i] != sources[start]:
                self._add_run(sources[start], table.slice(start, i - start))
                start = i

    def finish(self) -> dict[str, SourceAccount]:
        self._flush()
        return self.accounts

    def _add_run(self, source: str, table: pa.Table) -> None:
        if source != self._source:
            self._flush()
            self._source = source
        account = self.accounts[source]
        keep = np.zeros(table.num_rows, dtype=bool)
        rows = zip(
            table.column("doc_id").to_pylist(),
            table.column("reason").to_pylist(),
            table.column("location").to_pylist(),
            strict=True,
        )
        for i, (doc_id, reason, location) in enumerate(rows):
            account.docs_in += 1
            if reason is None and doc_id in self._seen:
                reason = "duplicate"
            if reason is not None:
                account.reject(reason, location)
            else:
                self._seen.add(doc_id)
                keep[i] = True
        self._append(table.filter(pa.array(keep)).select(list(SHARD_COLUMNS)))

    def _append(self, table: pa.Table) -> None:
        """Buffer rows; cut a shard at the first document that reaches the target."""
        while table.num_rows:
            cum = np.cumsum(table.column("n_tokens").to_numpy()) * self.itemsize
            cut = int(np.searchsorted(cum, self.target - self._pending_bytes, side="left"))
            if cut >= table.num_rows:
                self._pending.append(table)
                self._pending_bytes += int(cum[-1])
                return
            self._pending.append(table.slice(0, cut + 1))
            self._flush()
            table = table.slice(cut + 1)

    def _flush(self) -> None:
        if not self._pending or self._source is None:
            return
        table = pa.concat_tables(self._pending)
        self._pending, self._pending_bytes = [], 0
        if not table.num_rows:
            return
        account = self.accounts[self._source]
        rel = f"{self._source}/{SHARD_NAME.format(len(account.shards))}"
        digest = write_shard(self.out_dir / rel, table)
        tokens = int(table.column("n_tokens").to_numpy().sum())
        account.shards.append(
            {"file": rel, "rows": table.num_rows, "tokens": tokens, "sha256": digest}
        )
        account.docs_out += table.num_rows
        account.tokens += tokens
