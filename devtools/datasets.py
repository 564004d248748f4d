"""Small prepared datasets in the contract-2 format, for tests and benchmarks.

Real text (the Python standard library's source and docstrings), written as
raw JSONL sources and prepared by `trainlab prep`'s own code (`run_prep` with
the in-process executor: no Ray), so the same cleaning, deduplication,
tokenizer training, shard and manifest writers produce them as produce every
other dataset: there is one writer of the format.
"""

from __future__ import annotations

import ast
import json
import sysconfig
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def stdlib_files(limit: int, min_bytes: int = 200) -> list[Path]:
    """The first `limit` standard-library .py files (sorted, stable across runs)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.glob("*.py")) if p.stat().st_size >= min_bytes]
    return files[:limit]


def stdlib_code(limit: int, max_chars: int = 40_000) -> list[str]:
    """Source files of the standard library (real code documents, some long)."""
    return [
        p.read_text(encoding="utf-8", errors="replace")[:max_chars] for p in stdlib_files(limit)
    ]


def stdlib_docstrings(limit: int) -> list[str]:
    """Docstrings of standard-library modules and their functions (real prose)."""
    out: list[str] = []
    for p in stdlib_files(10 * limit):
        try:
            tree = ast.parse(p.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    out.append(doc)
                    if len(out) >= limit:
                        return out
    return out


def write_prepared_dataset(
    root: str | Path,
    texts: Mapping[str, Sequence[str]],
    vocab_size: int,
    shard_target_mb: float = 64.0,
) -> dict[str, Any]:
    """Prepare `texts` ({source: documents}, sources in this order) into `root` with
    `trainlab prep`'s pipeline in this process, training a byte-level BPE of
    `vocab_size` on them; return the manifest dict. The documents go through prep
    as they would from any raw source (one JSONL file per source), so cleaning and
    deduplication apply: an exact repeat of an earlier document is dropped."""
    from trainlab.data.prep.pipeline import run_prep

    with tempfile.TemporaryDirectory(prefix="trainlab-raw-") as tmp:
        raw = Path(tmp)
        entries = []
        for name, docs in texts.items():
            lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
            (raw / f"{name}.jsonl").write_text(lines, encoding="utf-8")
            entries.append(
                {"name": name, "paths": [f"{name}.jsonl"], "format": "jsonl", "text_field": "text"}
            )
        sources = {
            "train_tokenizer": {"vocab_size": vocab_size},
            "shard_target_mb": shard_target_mb,
            "sources": entries,
        }
        (raw / "sources.yaml").write_text(json.dumps(sources, indent=2))  # JSON is YAML
        return run_prep(raw / "sources.yaml", root, executor="local").manifest


def write_stdlib_dataset(
    root: str | Path, code_docs: int = 120, prose_docs: int = 300, vocab_size: int = 2048
) -> dict[str, Any]:
    """Two real sources: `code` (stdlib modules, long documents) and `docs` (docstrings,
    short ones), tokenized with a BPE trained on them."""
    texts = {"code": stdlib_code(code_docs), "docs": stdlib_docstrings(prose_docs)}
    return write_prepared_dataset(root, texts, vocab_size, shard_target_mb=1.0)


def small_dataset(root: str | Path) -> Path:
    """A small three-source dataset at `root` (written once; reused if present):
    `code` (long documents), `docs` (short ones) and `tiny` (a handful of
    documents, so any real share of it repeats for several epochs)."""
    root = Path(root)
    if not (root / "manifest.json").exists():
        docstrings = stdlib_docstrings(160)
        texts = {
            "code": stdlib_code(24, max_chars=12_000),
            "docs": docstrings[:150],
            "tiny": docstrings[150:156],
        }
        write_prepared_dataset(root, texts, vocab_size=1024, shard_target_mb=0.02)
    return root
