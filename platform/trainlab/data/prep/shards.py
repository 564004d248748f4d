"""Shards and accounts: writing one Parquet shard, and where every record of a
source went (`SourceAccount`, merged by the driver from per-unit summaries).

Shards hold a source's kept documents in dedup order; where one ends depends
only on the documents (see `stages`), never on how the work was cut or
scheduled, and a shard's bytes never depend on how its rows were batched, so
the same inputs always give byte-identical shards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

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

    def merge(self, docs_in: int, rejected: dict[str, dict]) -> None:
        """Add one unit's accounts (units merged in dedup order keep the examples
        the first ones)."""
        self.docs_in += docs_in
        for reason, entry in rejected.items():
            mine = self.rejected[reason]
            mine["count"] += entry["count"]
            room = MAX_EXAMPLES - len(mine["examples"])
            mine["examples"].extend(entry["examples"][: max(0, room)])

    def add_shard(self, out_dir: Path, shard: dict) -> None:
        """Record the next written shard, renamed to the next number in sequence
        when empty shard slots were skipped (a document bigger than the target)."""
        rel = f"{self.name}/{SHARD_NAME.format(len(self.shards))}"
        if shard["file"] != rel:
            os.replace(out_dir / shard["file"], out_dir / rel)
        self.shards.append(
            {
                "file": rel,
                "rows": shard["rows"],
                "tokens": shard["token_count"],
                "sha256": shard["sha256"],
            }
        )
        self.docs_out += shard["rows"]
        self.tokens += shard["token_count"]

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


def _canonical(table: pa.Table) -> pa.Table:
    """The token lists' item field named "element", as Parquet names it on reading:
    the Arrow schema stored in a shard's footer never depends on which format the
    rows passed through on their way here."""
    i = table.schema.get_field_index("tokens")
    value = table.schema.field(i).type.value_field
    if value.name == "element":
        return table
    return table.set_column(
        i, "tokens", table.column(i).cast(pa.list_(value.with_name("element")))
    )


def write_shard(path: Path, table: pa.Table) -> str:
    """Write one zstd Parquet shard atomically; return its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    # One chunk per column, so page boundaries (and so the bytes) never depend on
    # how the rows were batched on their way here.
    pq.write_table(_canonical(table).combine_chunks(), tmp, compression="zstd")
    digest = sha256_file(tmp)
    os.replace(tmp, path)
    return digest
