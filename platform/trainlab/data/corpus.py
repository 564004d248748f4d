"""A prepared dataset in memory: per source, one flat token array plus document
offsets (the nanoGPT layout), and the held-out validation split.

The split is by document and depends only on each document's `doc_id` and
`data.val_fraction` (not on the seed or the mix), so every experiment on the
same dataset is validated on the same documents.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from trainlab.data.manifest import Manifest, Shard, load_manifest
from trainlab.errors import UserError

MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A fixed 64-bit mixing function (SplitMix64), vectorized.

    Used instead of numpy's Generator for shuffles so the stream stays identical
    across numpy versions (Generator streams are not guaranteed to)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def stable_hash64(*parts: int | str) -> int:
    """A 64-bit hash of ints and strings that never changes between processes."""
    blob = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")


def doc_id_hashes(doc_ids: list[str]) -> np.ndarray:
    return np.fromiter(
        (stable_hash64("val", d) for d in doc_ids), dtype=np.uint64, count=len(doc_ids)
    )


def validation_split(doc_ids: list[str], val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) document indices. The val set is the round(n * val_fraction)
    documents with the smallest hash of their doc_id: at least one when the
    fraction is positive, never all of them. Both come back sorted by that hash,
    which also fixes the validation order."""
    n = len(doc_ids)
    order = np.argsort(doc_id_hashes(doc_ids), kind="stable")
    wanted = round(n * val_fraction)
    n_val = min(max(wanted, 1), n - 1) if val_fraction > 0 and n >= 2 else 0
    return np.sort(order[n_val:]), order[:n_val]


@dataclass(frozen=True)
class SourceTokens:
    """One source's documents in dedup order. Document d is
    tokens[offsets[d]:offsets[d + 1]] (EOS included)."""

    name: str
    tokens: np.ndarray  # uint16 / uint32, flat
    offsets: np.ndarray  # int64, n_docs + 1
    train_docs: np.ndarray  # int64 document indices, ascending
    val_docs: np.ndarray  # int64 document indices, in validation order

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def read_columns(manifest: Manifest, shard: Shard, columns: list[str]) -> Any:
    """A shard's columns as a pyarrow Table, from wherever the dataset is (a local
    directory or an object store, read directly: Parquet fetches only the byte
    ranges of these columns); a UserError if it is not what prep writes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = manifest.location
    try:
        return pq.read_table(where.fs_path(shard.file), columns=columns, filesystem=where.filesystem)
    except (pa.ArrowException, OSError, KeyError) as e:
        raise UserError(
            f"{manifest.shard_path(shard)}: cannot read columns {columns} ({e})"
        ) from None


def read_doc_index(manifest: Manifest, source: str) -> tuple[list[str], np.ndarray]:
    """doc_id and n_tokens of every document of `source`, without reading tokens."""
    ids: list[str] = []
    lengths = []
    for shard in manifest.sources[source].shards:
        table = read_columns(manifest, shard, ["doc_id", "n_tokens"])
        ids.extend(table.column("doc_id").to_pylist())
        lengths.append(table.column("n_tokens").to_numpy().astype(np.int64))
    return ids, np.concatenate(lengths) if lengths else np.zeros(0, np.int64)


def read_source(manifest: Manifest, source: str, val_fraction: float) -> SourceTokens:
    chunks, lengths, ids = [], [], []
    for shard in manifest.sources[source].shards:
        path = manifest.shard_path(shard)
        table = read_columns(manifest, shard, ["doc_id", "tokens", "n_tokens"])
        col = table.column("tokens").combine_chunks()
        n = np.diff(col.offsets.to_numpy()).astype(np.int64)
        declared = table.column("n_tokens").to_numpy().astype(np.int64)
        if not np.array_equal(n, declared):
            bad = int(np.flatnonzero(n != declared)[0])
            raise UserError(f"{path}: row {bad} has {n[bad]} tokens but n_tokens = {declared[bad]}")
        if (n == 0).any():
            raise UserError(f"{path}: row {int(np.flatnonzero(n == 0)[0])} has no tokens")
        chunks.append(
            col.flatten().to_numpy(zero_copy_only=False).astype(manifest.token_dtype, copy=False)
        )
        lengths.append(n)
        ids.extend(table.column("doc_id").to_pylist())
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, manifest.token_dtype)
    offsets = np.zeros(len(ids) + 1, np.int64)
    if lengths:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    if len(tokens) and int(tokens.max()) >= manifest.vocab_size:
        raise UserError(
            f"{manifest.root}: source {source!r} has token id {int(tokens.max())} "
            f">= tokenizer.vocab_size {manifest.vocab_size}"
        )
    train, val = validation_split(ids, val_fraction)
    return SourceTokens(
        name=source,
        tokens=tokens,
        offsets=offsets,
        train_docs=train.astype(np.int64),
        val_docs=val.astype(np.int64),
    )


@lru_cache(maxsize=4)
def load_corpus(
    root: str, fingerprint: str, sources: tuple[str, ...], val_fraction: float
) -> dict[str, SourceTokens]:
    """The listed sources of the dataset at `root`, read once per process.

    `fingerprint` is part of the cache key and is checked, so a dataset
    re-prepared under the same path is never served from a stale cache."""
    manifest = load_manifest(root)
    if manifest.fingerprint != fingerprint:
        raise UserError(
            f"{root}: fingerprint is {manifest.fingerprint[:12]}..., expected "
            f"{fingerprint[:12]}... (the prepared dataset changed under this run)"
        )
    return {s: read_source(manifest, s, val_fraction) for s in sources}
