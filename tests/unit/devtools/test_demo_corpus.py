"""The demo corpus: three real domains in three raw formats, built from the
running Python; rebuilding changes nothing; demo.yaml prepares it."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest

from devtools.demo_corpus import DEMO_RAW, DEMO_SOURCES, build_demo_corpus
from trainlab.data.prep import run_prep


@pytest.mark.slow
def test_demo_corpus_builds_idempotently_and_prepares(tmp_path, repo):
    raw = tmp_path / DEMO_RAW
    stats = build_demo_corpus(raw, max_mb=0.5)
    assert set(stats) == {"code", "docs", "pkgdocs"}
    assert all(s["records"] > 0 for s in stats.values())
    assert stats["code"]["bytes"] <= 0.5 * 2**20
    assert (raw / "code/stdlib").is_dir() and (raw / "docs/topics.jsonl").is_file()
    assert pq.read_schema(raw / "pkgdocs/metadata.parquet").names == [
        "name",
        "version",
        "summary",
        "text",
    ]
    mtimes = {p: p.stat().st_mtime_ns for p in raw.rglob("*.*") if p.name != ".corpus.json"}
    (raw / ".corpus.json").unlink()  # force a rebuild: identical files stay untouched
    assert build_demo_corpus(raw, max_mb=0.5) == stats
    assert {p: p.stat().st_mtime_ns for p in raw.rglob("*.*") if p.name != ".corpus.json"} == mtimes

    sources = tmp_path / DEMO_SOURCES
    sources.parent.mkdir(parents=True)
    shutil.copyfile(repo / DEMO_SOURCES, sources)
    m = run_prep(sources, tmp_path / "prepared", vocab_size=300, executor="local").manifest
    assert list(m["sources"]) == ["code", "docs", "pkgdocs"]
    for s in m["sources"].values():
        assert s["docs_out"] > 0
        assert s["docs_in"] == s["docs_out"] + sum(r["count"] for r in s["rejected"].values())
