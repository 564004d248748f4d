"""Deduplication across the whole corpus as a hash-partitioned shuffle.

Each unit emits *keys* for its kept documents (`unit_keys`): one exact key per
document (its `doc_id`) and, with near-dedup on, one key per LSH band of the
document's MinHash signature. Keys are spread over partitions by their 64-bit
hash (`partition_bounds`); each partition is owned by one worker
(`reduce_partition`), which sees every copy of the keys it owns and decides
the losers by each document's global position (source, file, row): the same
"first copy wins" order as a single process reading everything in order,
whatever the number of partitions, units or workers.

- exact: every document with an earlier one of the same `doc_id` is a
  `duplicate`.
- near: every document sharing an LSH bucket with an earlier one whose
  signature agrees on at least `threshold` of its values (the MinHash estimate
  of their Jaccard similarity) is a `near_duplicate`. The earlier document may
  itself be a duplicate: "an earlier, similar text exists" is what decides.

MinHash is datasketch's (`datasketch.MinHash`, 32-bit affine permutations of
SHA-1 hashes, fixed seed): a kept library, exact and deterministic; the number
of bands and rows per band for a threshold is datasketch's own choice
(`MinHashLSH`'s weighted false-positive/false-negative optimum).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trainlab.data.prep.spec import NearDedupSettings

MINHASH_SEED = 1
# A member of a bucket is checked against at most this many members just before
# it (a bucket of thousands is boilerplate; a near-copy among its neighbours
# decides it, and the cost stays linear).
MAX_BUCKET_COMPARISONS = 256
EXACT, BAND = 0, 1

KEY_SCHEMA = pa.schema(
    [
        ("key", pa.uint64()),  # partitioning hash
        ("kind", pa.int8()),  # EXACT or BAND
        ("doc_id", pa.string()),  # EXACT rows: compared in full (the key is 64 bits)
        ("file", pa.int32()),  # within the unit
        ("row", pa.int64()),  # within the file
        ("sig", pa.binary()),  # BAND rows: the whole signature (uint32 x num_perm)
    ]
)
LOSER_SCHEMA = pa.schema(
    [
        ("source", pa.int32()),  # index in the sources file
        ("file", pa.int64()),  # index among the source's files
        ("row", pa.int64()),
        ("reason", pa.string()),
    ]
)
KEY_ROW_GROUP = 4096


@functools.lru_cache(maxsize=8)
def lsh_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows per band) for the threshold: datasketch's optimum."""
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    return int(lsh.b), int(lsh.r)


@functools.lru_cache(maxsize=8)
def _permutations(num_perm: int) -> object:
    from datasketch import MinHash

    return MinHash(num_perm=num_perm, seed=MINHASH_SEED, scheme="affine32").permutations


def shingles(text: str, settings: NearDedupSettings) -> list[bytes]:
    """The document's n-grams (words split on whitespace, or characters), as bytes;
    a text shorter than n is one n-gram."""
    n = settings.ngram
    if settings.shingle == "word":
        words = text.split()
        grams = [" ".join(words[i : i + n]) for i in range(max(1, len(words) - n + 1))]
    else:
        grams = [text[i : i + n] for i in range(max(1, len(text) - n + 1))]
    return [g.encode("utf-8", "surrogatepass") for g in set(grams)]


def signature(text: str, settings: NearDedupSettings) -> np.ndarray:
    from datasketch import MinHash

    m = MinHash(
        num_perm=settings.num_perm,
        seed=MINHASH_SEED,
        scheme="affine32",
        permutations=_permutations(settings.num_perm),
    )
    m.update_batch(shingles(text, settings))
    return np.asarray(m.hashvalues, dtype=np.uint32)


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def unit_keys(
    table: pa.Table, texts: list[str | None], exact: bool, near: NearDedupSettings
) -> pa.Table:
    """The dedup keys of a unit's kept documents (`reason` null), sorted by key."""
    cols: dict[str, list] = {name: [] for name in KEY_SCHEMA.names}
    bands, rows = lsh_bands(near.threshold, near.num_perm) if near.enabled else (0, 0)

    def add(key: int, kind: int, doc_id: str | None, f: int, r: int, sig: bytes | None) -> None:
        for name, value in zip(KEY_SCHEMA.names, (key, kind, doc_id, f, r, sig), strict=True):
            cols[name].append(value)

    for doc_id, reason, f, r, text in zip(
        table.column("doc_id").to_pylist(),
        table.column("reason").to_pylist(),
        table.column("file").to_pylist(),
        table.column("row").to_pylist(),
        texts,
        strict=True,
    ):
        if reason is not None:
            continue
        if exact:
            add(int(doc_id[:16], 16), EXACT, doc_id, f, r, None)
        if near.enabled:
            sig = signature(text or "", near)
            raw = sig.tobytes()
            for b in range(bands):
                band = sig[b * rows : (b + 1) * rows].tobytes()
                add(_hash64(b.to_bytes(2, "little") + band), BAND, None, f, r, raw)
    keys = pa.table(cols, schema=KEY_SCHEMA)
    return keys.sort_by("key")


def write_keys(path: Path, keys: pa.Table) -> None:
    """Sorted by key in small row groups, so a partition reads only its range."""
    pq.write_table(keys, path, row_group_size=KEY_ROW_GROUP, compression="zstd")


def partition_bounds(partitions: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of the 64-bit key space, one per partition (hi of the last
    is 2**64, i.e. open)."""
    step = 2**64 // partitions
    edges = [i * step for i in range(partitions)] + [2**64]
    return list(zip(edges[:-1], edges[1:], strict=True))


def read_partition(units: list[tuple[str, int, int]], lo: int, hi: int) -> pa.Table:
    """The keys with lo <= key < hi of every unit's key file, one scan over all of
    them (row-group statistics skip the rest), with each row's global position:
    `units` gives (key file, source index, file offset) per unit."""
    import pyarrow.dataset as ds

    key = ds.field("key")
    where = key >= pa.scalar(lo, pa.uint64())
    if hi < 2**64:
        where = where & (key < pa.scalar(hi, pa.uint64()))
    dataset = ds.dataset([u[0] for u in units], format="parquet", schema=KEY_SCHEMA)
    t = dataset.to_table(columns=[*KEY_SCHEMA.names, "__filename"], filter=where)
    which = pc.index_in(t.column("__filename"), pa.array([u[0] for u in units]))
    which = which.to_numpy(zero_copy_only=False)
    sources = np.array([u[1] for u in units], np.int32)[which]
    offsets = np.array([u[2] for u in units], np.int64)[which]
    files = t.column("file").to_numpy(zero_copy_only=False).astype(np.int64) + offsets
    t = t.drop_columns(["__filename", "file"])
    return t.append_column("source", pa.array(sources)).append_column("file", pa.array(files))


def reduce_partition(
    units: list[tuple[str, int, int]], lo: int, hi: int, threshold: float
) -> pa.Table:
    """The losers among the keys in [lo, hi) of every unit's key file.

    `units`: (key file, source index, file offset) per unit, in any order."""
    keys = read_partition(units, lo, hi)
    if not keys.num_rows:
        return LOSER_SCHEMA.empty_table()
    # Global dedup order: (source, file, row); winners are the first in each group.
    order = [("source", "ascending"), ("file", "ascending"), ("row", "ascending")]
    losers: list[tuple[int, int, int, str]] = []
    exact = keys.filter(pc.equal(keys.column("kind"), EXACT))
    losers += _exact_losers(exact.sort_by([("doc_id", "ascending"), *order]))
    band = keys.filter(pc.equal(keys.column("kind"), BAND))
    losers += _near_losers(band.sort_by([("key", "ascending"), *order]), threshold)
    losers.sort()
    return pa.table(
        {
            "source": pa.array([x[0] for x in losers], pa.int32()),
            "file": pa.array([x[1] for x in losers], pa.int64()),
            "row": pa.array([x[2] for x in losers], pa.int64()),
            "reason": pa.array([x[3] for x in losers], pa.string()),
        },
        schema=LOSER_SCHEMA,
    )


def _positions(t: pa.Table) -> list[tuple[int, int, int]]:
    return list(
        zip(
            t.column("source").to_pylist(),
            t.column("file").to_pylist(),
            t.column("row").to_pylist(),
            strict=True,
        )
    )


def _exact_losers(t: pa.Table) -> list[tuple[int, int, int, str]]:
    out = []
    prev: str | None = None
    for doc_id, pos in zip(t.column("doc_id").to_pylist(), _positions(t), strict=True):
        if doc_id == prev:
            out.append((*pos, "duplicate"))
        prev = doc_id
    return out


def _near_losers(t: pa.Table, threshold: float) -> list[tuple[int, int, int, str]]:
    """Within each bucket (rows in position order), a member goes when an earlier
    member's signature agrees with its own on >= threshold of the values."""
    if not t.num_rows:
        return []
    keys = t.column("key").to_numpy()
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    ends = np.r_[starts[1:], len(keys)]
    positions = _positions(t)
    sigs = t.column("sig").to_pylist()
    out = []
    for s, e in zip(starts, ends, strict=True):
        if e - s < 2:
            continue
        bucket = np.stack([np.frombuffer(sigs[i], dtype=np.uint32) for i in range(s, e)])
        for j in range(1, e - s):
            earlier = bucket[max(0, j - MAX_BUCKET_COMPARISONS) : j]
            if ((earlier == bucket[j]).mean(axis=1) >= threshold).any():
                out.append((*positions[s + j], "near_duplicate"))
    return out


def losers_in_range(
    loser_files: list[str], source: int, first_file: int, end_file: int
) -> dict[tuple[int, int], str]:
    """(file index among the source's files, row) -> reason for the documents of
    files [first_file, end_file) of one source, from every partition's loser file
    (one read each); a document both exact and near loser is a duplicate."""
    found: dict[tuple[int, int], str] = {}
    filters = [
        ("source", "=", source),
        ("file", ">=", first_file),
        ("file", "<", end_file),
    ]
    for path in loser_files:
        t = pq.read_table(path, filters=filters, schema=LOSER_SCHEMA)
        for f, r, reason in zip(
            t.column("file").to_pylist(),
            t.column("row").to_pylist(),
            t.column("reason").to_pylist(),
            strict=True,
        ):
            if found.get((f, r)) != "duplicate":
                found[(f, r)] = reason
    return found
