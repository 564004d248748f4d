"""Deduplication: exact copies by normalized content hash, within and across
sources; the kept copy is the first by source order, then path, then position,
whatever the source names and however the work was cut into units."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from trainlab.data.prep import run_prep
from trainlab.data.prep.cleaning import content_id


def put(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


SHARED = "The same paragraph appears in several places of the corpus, word for word."
OTHER = "A paragraph that exists exactly once, so nobody drops it as a copy."


def corpus(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    # `zeta` comes first in the sources file, so its copy wins over `alpha`'s,
    # although "alpha" sorts first.
    put(raw / "zeta/b.txt", SHARED)
    put(raw / "zeta/a.txt", OTHER)
    put(
        raw / "alpha/docs.jsonl",
        "".join(
            json.dumps({"text": t}) + "\n"
            for t in [OTHER + " (alpha)", SHARED, SHARED.replace(" ", " ")]
        ),
    )
    put(raw / "alpha/z.jsonl", json.dumps({"text": "cafe\u0301 " + SHARED}) + "\n")
    put(raw / "alpha/y.jsonl", json.dumps({"text": "caf\u00e9 " + SHARED}) + "\n")
    (tmp_path / "s.yaml").write_text("""
root: raw
train_tokenizer: {vocab_size: 300}
sources:
  - {name: zeta, paths: [zeta/], format: text}
  - {name: alpha, paths: ["alpha/*.jsonl"], format: jsonl, text_field: text}
""")
    return tmp_path / "s.yaml"


def shard_doc_ids(out: Path, manifest: dict, source: str) -> list[str]:
    ids: list[str] = []
    for shard in manifest["sources"][source]["shards"]:
        ids += pq.read_table(out / shard["file"], columns=["doc_id"]).column(0).to_pylist()
    return ids


def test_first_copy_by_source_order_then_path_then_position(tmp_path):
    sources = corpus(tmp_path)
    m = run_prep(sources, tmp_path / "out", executor="local").manifest
    zeta, alpha = m["sources"]["zeta"], m["sources"]["alpha"]
    assert zeta["docs_out"] == 2 and zeta["rejected"]["duplicate"]["count"] == 0
    dup = alpha["rejected"]["duplicate"]
    # docs.jsonl lines 2 and 3 repeat zeta/b.txt; z.jsonl (NFD) repeats y.jsonl (NFC),
    # and y.jsonl comes first by path.
    raw = tmp_path / "raw/alpha"
    assert dup["count"] == 3
    assert dup["examples"] == [f"{raw}/docs.jsonl:2", f"{raw}/docs.jsonl:3", f"{raw}/z.jsonl:1"]
    assert alpha["docs_out"] == 2
    # Shard rows are in dedup order: path order within a source.
    assert shard_doc_ids(tmp_path / "out", m, "zeta") == [content_id(OTHER), content_id(SHARED)]
    assert shard_doc_ids(tmp_path / "out", m, "alpha") == [
        content_id(OTHER + " (alpha)"),
        content_id("caf\u00e9 " + SHARED),
    ]
    assert (
        len(
            set(shard_doc_ids(tmp_path / "out", m, "zeta"))
            & set(shard_doc_ids(tmp_path / "out", m, "alpha"))
        )
        == 0
    )


def test_result_does_not_depend_on_how_work_is_cut(tmp_path):
    """One unit per file, or everything in one unit: the same bytes on disk."""
    sources = corpus(tmp_path)
    a = run_prep(sources, tmp_path / "a", executor="local", unit_bytes=1).manifest
    b = run_prep(sources, tmp_path / "b", executor="local", unit_bytes=1 << 30).manifest
    assert a["fingerprint"] == b["fingerprint"]
    assert a["sources"] == b["sources"]
