"""manifest.json: what a prepared dataset holds, and whether it is still current.

The manifest is written last, atomically; a directory without one is not a
finished dataset. `input_signature` (beyond contract 2's keys) identifies the
inputs and settings the dataset was built from, so a re-run with the same
ones can say "up to date" and do nothing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from trainlab.data.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    ManifestDoc,
    dataset_fingerprint,
    parse_manifest,
)
from trainlab.data.prep.shards import SourceAccount, atomic_write_bytes
from trainlab.data.prep.tokenizer import TokenizerInfo
from trainlab.errors import UserError
from trainlab.fileutil import sha256_file


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def signature(obj: Any) -> str:
    """sha256 of a JSON-able object, independent of key order."""
    return hashlib.sha256(_canonical(obj)).hexdigest()


def fingerprint(tokenizer_sha256: str, cleaning: dict, accounts: dict[str, SourceAccount]) -> str:
    """The dataset's identity (trainlab.data.manifest.dataset_fingerprint, which every
    reader recomputes): tokenizer, cleaning settings and every shard's checksum."""
    shards = [(name, s["file"], s["sha256"]) for name, acc in accounts.items() for s in acc.shards]
    return dataset_fingerprint(tokenizer_sha256, cleaning, shards)


def build_manifest(
    tokenizer: TokenizerInfo,
    cleaning: dict,
    accounts: dict[str, SourceAccount],
    input_signature: str,
) -> ManifestDoc:
    """The manifest of a finished build, checked as the reader checks it."""
    return ManifestDoc.model_validate(
        {
            "format_version": FORMAT_VERSION,
            "fingerprint": fingerprint(tokenizer.sha256, cleaning, accounts),
            "tokenizer": tokenizer.to_json(),
            "cleaning": cleaning,
            "sources": {name: acc.to_json() for name, acc in accounts.items()},
            "input_signature": input_signature,
        }
    )


def write_manifest(out_dir: Path, manifest: ManifestDoc) -> None:
    data = json.dumps(manifest.to_json(), indent=2) + "\n"
    atomic_write_bytes(out_dir / MANIFEST, data.encode())


def read_manifest(out_dir: Path) -> dict | None:
    """The manifest in `out_dir` as JSON, or None if there is none or it is unreadable."""
    try:
        data = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def current_manifest(out_dir: Path, input_signature: str) -> dict | None:
    """The existing manifest if it was built from exactly these inputs and every file
    it lists is intact (checksums match); otherwise None (the dataset is rebuilt)."""
    raw = read_manifest(out_dir)
    if not raw or raw.get("input_signature") != input_signature:
        return None
    try:
        doc = parse_manifest(raw, str(out_dir / MANIFEST))
    except UserError:
        return None
    files = [(doc.tokenizer.file, doc.tokenizer.sha256)]
    files += [(s.file, s.sha256) for src in doc.sources.values() for s in src.shards]
    for rel, digest in files:
        try:
            if sha256_file(out_dir / rel) != digest:
                return None
        except OSError:
            return None
    return doc.to_json()


def listed_files(manifest: dict | None) -> set[str]:
    """Shard paths (relative) a manifest lists; empty for None or a broken manifest."""
    try:
        return {s["file"] for src in manifest["sources"].values() for s in src["shards"]}
    except (KeyError, TypeError, AttributeError):
        return set()
