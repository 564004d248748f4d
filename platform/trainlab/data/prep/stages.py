"""The distributed stages of prep, each run by workers on small work items
(JSON dicts) and answering with one small summary row: the driver sends
paths and receives counts, never document data.

    sample  [a trained tokenizer] one unit's hash-sampled texts -> work/run/sample-I
    train   [a trained tokenizer] BPE on every sample        -> work/run/tokenizer.json
    unit    read -> clean -> hash -> tokenize -> dedup keys  -> work/units/*  (recorded)
    reduce  one key partition: every copy of its keys        -> work/run/losers-J
    settle  one unit: final reasons, accounts, kept rows     -> work/run/kept-I
    write   one shard: the kept rows of the units it spans   -> SOURCE/part-K.parquet

Even the tokenizer is trained by a worker, so the driver never holds the
sample. Shards are cut by the source's running total of kept token bytes: document d
goes to shard (end_d - 1) // target, where end_d is the total up to and
including d. That depends only on the documents (never on units, workers or
arrival order), and lets each shard be written by its own worker once the
driver has summed the per-unit totals.

Work items and summaries are plain tables, so the same functions run in Ray
Data workers (`executors.RayDataExecutor`) or in this process (`LocalExecutor`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainlab.data.prep.cleaning import REASONS
from trainlab.data.prep.dedup import (
    losers_in_range,
    reduce_partition,
    unit_keys,
    write_keys,
)
from trainlab.data.prep.shards import MAX_EXAMPLES, SHARD_COLUMNS, write_shard
from trainlab.data.prep.spec import NearDedupSettings, TokenizerTraining
from trainlab.data.prep.tokenizer import train_bpe
from trainlab.data.prep.units import (
    ByRef,
    TokenizeStage,
    WorkUnit,
    read_clean,
    read_clean_unit,
    sample_texts,
)

UNIT_DOC_COLUMNS = ("source", "file", "row", "location", "doc_id", "reason", "tokens", "n_tokens")


def write_docs(path: Path, docs: pa.Table) -> None:
    """A unit's tokenized documents, an intermediate file: Arrow IPC with LZ4 (its
    write and read cost ~0.05 CPU-s per 10 MB, against ~0.4 s for zstd Parquet;
    only the shards, the contract's files, pay for Parquet)."""
    import pyarrow.feather as feather

    feather.write_feather(docs, path, compression="lz4")


def read_docs(path: str | Path, columns: list[str]) -> pa.Table:
    import pyarrow.feather as feather

    return feather.read_table(path, columns=columns, memory_map=False)


def _items(batch: pa.Table) -> list[dict[str, Any]]:
    """The work items of a batch (each row holds a JSON list of them)."""
    return [i for s in batch.column("item").to_pylist() for i in json.loads(s)]


def _write_atomic(path: Path, write: Any) -> None:
    import os

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- tokenizer


def sample_stage(batch: pa.Table, fraction: float) -> pa.Table:
    """The tokenizer-training sample of each unit (see `units.sample_texts`)."""
    rows = []
    for item in _items(batch):
        sample = sample_texts(read_clean_unit(WorkUnit.from_json(item["unit"])), fraction)
        _write_atomic(Path(item["out"]), lambda p, t=sample: pq.write_table(t, p))
        rows.append({"index": item["index"], "docs": sample.num_rows})
    return pa.Table.from_pylist(rows)


def train_stage(batch: pa.Table, training: dict, eos_token: str) -> pa.Table:
    """BPE on the samples (read in unit order, each distinct text once: the same
    inputs give the same tokenizer); writes the tokenizer JSON."""
    rows = []
    for item in _items(batch):
        seen: set[str] = set()
        texts: list[str] = []
        for path in item["samples"]:
            t = pq.read_table(path)
            for doc_id, text in zip(
                t.column("doc_id").to_pylist(), t.column("text").to_pylist(), strict=True
            ):
                if doc_id not in seen:
                    seen.add(doc_id)
                    texts.append(text)
        if texts:
            data = train_bpe(texts, TokenizerTraining.model_validate(training), eos_token)
            _write_atomic(Path(item["out"]), lambda p, d=data: p.write_bytes(d))
        rows.append({"index": item["index"], "texts": len(texts)})
    return pa.Table.from_pylist(rows)


# --------------------------------------------------------------------------- unit


class UnitStage:
    """read -> clean -> hash -> tokenize one unit, with its dedup keys; writes the
    unit's documents and keys (keys first: the documents file marks it done)."""

    def __init__(
        self,
        tokenizer_json: str | ByRef,
        eos_id: int,
        dtype: str,
        threads: bool,
        exact: bool,
        near: dict,
    ):
        self.tokenize = TokenizeStage(tokenizer_json, eos_id, dtype, threads, exact)
        self.exact = exact
        self.near = NearDedupSettings.model_validate(near)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = [self.one(item) for item in _items(batch)]
        return pa.Table.from_pylist(rows)

    def one(self, item: dict[str, Any]) -> dict[str, Any]:
        unit = WorkUnit.from_json(item["unit"])
        cleaned, texts = read_clean(unit)
        tokenized = self.tokenize(cleaned, texts)
        cpu = time.process_time()
        keys = unit_keys(tokenized, texts, self.exact, self.near)
        docs = tokenized.select(list(UNIT_DOC_COLUMNS))
        _write_atomic(Path(item["keys"]), lambda p: write_keys(p, keys))
        _write_atomic(Path(item["docs"]), lambda p: write_docs(p, docs))
        return {
            "index": unit.index,
            "docs_in": cleaned.num_rows,
            "cpu_read_clean": float(tokenized.column("cpu_read_clean").to_numpy().sum()),
            "cpu_tokenize": float(tokenized.column("cpu_tokenize").to_numpy().sum()),
            "cpu_dedup_keys": time.process_time() - cpu,
            "node": _node_id(),
        }


# The UnitStage (its tokenizer) a worker process built last, by its settings.
_unit_stages: dict[str, UnitStage] = {}


def unit_stage(batch: pa.Table, **kwargs: Any) -> pa.Table:
    """`UnitStage` as a plain task. The stages after it reuse the same pool of task
    workers (an actor pool would start worker processes of its own, which costs
    seconds per stage), and a worker keeps the tokenizer it built for the next
    batch of the same run (its cache warm, the JSON not parsed again)."""
    key = _settings_key(kwargs)
    stage = _unit_stages.get(key)
    if stage is None:
        _unit_stages.clear()
        stage = _unit_stages[key] = UnitStage(**kwargs)
    return stage(batch)


def _settings_key(kwargs: dict[str, Any]) -> str:
    import hashlib

    def plain(v: Any) -> Any:
        if isinstance(v, ByRef):
            return ["ref", v.refs[0].hex()]  # type: ignore[attr-defined]
        if isinstance(v, str) and len(v) > 1000:
            return ["sha256", hashlib.sha256(v.encode()).hexdigest()]
        return v

    return json.dumps({k: plain(v) for k, v in kwargs.items()}, sort_keys=True)


def _node_id() -> str:
    """The Ray node this worker runs on ("local" outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


# --------------------------------------------------------------------------- reduce


def reduce_stage(batch: pa.Table, threshold: float) -> pa.Table:
    rows = []
    for item in _items(batch):
        losers = reduce_partition(
            [tuple(u) for u in item["units"]], int(item["lo"]), int(item["hi"]), threshold
        )
        _write_atomic(
            Path(item["out"]),
            lambda p, t=losers: pq.write_table(t, p, row_group_size=4096, compression="zstd"),
        )
        rows.append({"index": item["index"], "losers": losers.num_rows})
    return pa.Table.from_pylist(rows)


# --------------------------------------------------------------------------- settle


# Units settled on one read of the loser files: consecutive units of one source,
# up to this many bytes of input (their losers are held in memory together).
SETTLE_GROUP_BYTES = 64 << 20


def settle_stage(batch: pa.Table) -> pa.Table:
    """Settle the batch's units, reading every loser file once per group of
    consecutive units (`SETTLE_GROUP_BYTES`) rather than once per unit: a loser
    file read costs the same for one unit or many, and there are units x
    partitions of them."""
    rows = []
    for group in _settle_groups(_items(batch)):
        first = group[0]["file_offset"]
        end = max(i["file_offset"] + i["n_files"] for i in group)
        losers = losers_in_range(group[0]["losers"], group[0]["source_index"], first, end)
        rows += [_settle(item, losers) for item in group]
    return pa.Table.from_pylist(rows)


def _settle_groups(items: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    groups: list[list[dict[str, Any]]] = []
    size = 0
    for item in sorted(items, key=lambda i: (i["source_index"], i["file_offset"])):
        if (
            not groups
            or groups[-1][0]["source_index"] != item["source_index"]
            or size + item["weight"] > SETTLE_GROUP_BYTES
        ):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item["weight"]
    return groups


def _settle(item: dict[str, Any], losers: dict[tuple[int, int], str]) -> dict[str, Any]:
    """Every record of the unit gets its final fate (`losers`: by file index among
    the source's files, and row); the kept rows (and their token counts) go to the
    unit's kept file, the accounts to the driver."""
    docs = read_docs(item["docs"], ["file", "row", "location", "reason", "n_tokens"])
    offset = item["file_offset"]
    rejected = {r: {"count": 0, "examples": []} for r in REASONS}
    kept_rows, kept_tokens = [], []
    n_tokens = docs.column("n_tokens").to_numpy()
    for i, (f, r, location, reason) in enumerate(
        zip(
            docs.column("file").to_pylist(),
            docs.column("row").to_pylist(),
            docs.column("location").to_pylist(),
            docs.column("reason").to_pylist(),
            strict=True,
        )
    ):
        reason = reason or losers.get((offset + f, r))
        if reason is None:
            kept_rows.append(i)
            kept_tokens.append(int(n_tokens[i]))
            continue
        entry = rejected[reason]
        entry["count"] += 1
        if len(entry["examples"]) < MAX_EXAMPLES:
            entry["examples"].append(location)
    kept = pa.table(
        {"row": pa.array(kept_rows, pa.int64()), "n_tokens": pa.array(kept_tokens, pa.int64())}
    )
    _write_atomic(Path(item["kept"]), lambda p: pq.write_table(kept, p))
    return {
        "index": item["index"],
        "docs_in": docs.num_rows,
        "docs_out": len(kept_rows),
        "token_count": int(sum(kept_tokens)),
        "rejected": json.dumps(rejected),
    }


# --------------------------------------------------------------------------- write


def write_stage(batch: pa.Table) -> pa.Table:
    return pa.Table.from_pylist([_write(item) for item in _items(batch)])


def shard_slice(kept: pa.Table, start_bytes: int, itemsize: int, target: int, k: int) -> np.ndarray:
    """Rows (of the unit's documents) of the kept documents that go to shard k."""
    ends = start_bytes + np.cumsum(kept.column("n_tokens").to_numpy()) * itemsize
    return kept.column("row").to_numpy()[(ends - 1) // target == k]


def _write(item: dict[str, Any]) -> dict[str, Any]:
    parts = []
    for docs_path, kept_path, start in item["parts"]:
        rows = shard_slice(
            pq.read_table(kept_path), int(start), item["itemsize"], item["target"], item["k"]
        )
        if len(rows):
            docs = read_docs(docs_path, list(SHARD_COLUMNS))
            parts.append(docs.take(pa.array(rows)))
    result = {"index": item["index"], "file": None, "rows": 0, "token_count": 0, "sha256": None}
    if not parts:
        return result
    table = pa.concat_tables(parts).select(list(SHARD_COLUMNS))
    digest = write_shard(Path(item["out"]), table)
    tokens = int(table.column("n_tokens").to_numpy().sum())
    return result | {
        "file": item["file"],
        "rows": table.num_rows,
        "token_count": tokens,
        "sha256": digest,
    }
