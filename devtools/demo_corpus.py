"""The demo corpus: real text no one here wrote, from what every Python carries.

Three domains of different size and kind, each in a different raw format so
every reader is exercised:

- `code`    (text files): standard-library Python source, copied as is (a few
            files are deliberately not UTF-8 or empty: real rejections).
            The benchmark variant adds the environment's site-packages source.
- `docs`    (JSONL): the Python documentation topics (pydoc_data.topics) and
            the docstrings of standard-library modules (module docstrings, and
            class/function docstrings long enough to be prose).
- `pkgdocs` (Parquet): the long descriptions (README prose) in the METADATA of
            the installed distributions; those without one are null.

Files are chosen deterministically (by a hash of their path, so a size cap
keeps a spread, not the alphabet's start) and written only when their content
changes, so rebuilding leaves mtimes alone and `trainlab prep` stays up to date.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MB = 1 << 20
BUILDER_VERSION = 1
STAMP = ".corpus.json"
DEMO_SOURCES = Path("data_prep/sources/demo.yaml")
DEMO_RAW = Path("data/demo/raw")
DEMO_PREPARED = Path("data/demo/prepared")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# Class and function docstrings shorter than this are API notes rather than prose.
_MIN_DOCSTRING_CHARS = 200


def build_demo_corpus(
    out: str | Path = DEMO_RAW, max_mb: float = 6.0, with_site_packages: bool = False
) -> dict[str, dict[str, int]]:
    """Write the corpus under `out` (code/, docs/, pkgdocs/); at most `max_mb` MB of
    raw input per domain. Returns {domain: {"files", "records", "bytes"}}."""
    out = Path(out)
    key = {
        "builder": BUILDER_VERSION,
        "max_mb": max_mb,
        "site_packages": with_site_packages,
        "python": sysconfig.get_python_version(),
        "dists": _dist_names(),
    }
    stamp = _read_stamp(out)
    if stamp.get("key") == key and all((out / d).is_dir() for d in ("code", "docs", "pkgdocs")):
        return stamp["stats"]
    cap = int(max_mb * MB)
    stats = {
        "code": build_code(out / "code", cap, with_site_packages),
        "docs": build_docs(out / "docs", cap),
        "pkgdocs": build_pkgdocs(out / "pkgdocs", cap),
    }
    _write_if_changed(out / STAMP, json.dumps({"key": key, "stats": stats}, indent=2).encode())
    return stats


# --------------------------------------------------------------------------- code


def _python_files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("."):
                yield Path(dirpath) / name


def _code_roots(with_site_packages: bool) -> dict[str, Path]:
    paths = sysconfig.get_paths()
    roots = {"stdlib": Path(paths["stdlib"])}
    if with_site_packages:
        roots["site-packages"] = Path(paths["purelib"])
    return roots


def _spread_key(name: str) -> str:
    return hashlib.blake2b(name.encode(), digest_size=8).hexdigest()


def build_code(dest: Path, cap: int, with_site_packages: bool = False) -> dict[str, int]:
    """Copy Python source files byte for byte, chosen by path hash up to `cap` bytes."""
    candidates = [
        (f"{label}/{p.relative_to(root).as_posix()}", p)
        for label, root in _code_roots(with_site_packages).items()
        for p in _python_files(root)
    ]
    chosen: dict[str, Path] = {}
    total = 0
    for rel, path in sorted(candidates, key=lambda c: _spread_key(c[0])):
        size = path.stat().st_size
        if total + size > cap:
            continue
        chosen[rel] = path
        total += size
    for rel, path in chosen.items():
        _write_if_changed(dest / rel, path.read_bytes())
    _remove_others(dest, set(chosen))
    return {"files": len(chosen), "records": len(chosen), "bytes": total}


# --------------------------------------------------------------------------- docs


def _docstrings(path: Path, module: str) -> Iterator[dict[str, str]]:
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return
    doc = ast.get_docstring(tree)
    if doc:
        yield {"module": module, "kind": "module", "name": module, "text": doc}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                yield {"module": module, "kind": kind, "name": node.name, "text": doc}


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def build_docs(dest: Path, cap: int) -> dict[str, int]:
    """topics.jsonl (the documentation topics) and docstrings.jsonl, `cap` bytes in all."""
    from pydoc_data.topics import topics

    topic_records = [{"topic": k, "text": topics[k]} for k in sorted(topics)]
    data = {"topics.jsonl": _jsonl(topic_records)}
    total = len(data["topics.jsonl"])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    doc_records: list[dict] = []
    for path in sorted(_python_files(stdlib), key=lambda p: _spread_key(p.as_posix())):
        rel = path.relative_to(stdlib)
        if total >= cap:
            break
        if {"test", "tests", "idle_test"} & set(rel.parts):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for rec in _docstrings(path, module):
            total += len(json.dumps(rec, ensure_ascii=False)) + 1
            doc_records.append(rec)
    doc_records.sort(key=lambda r: (r["module"], r["kind"] != "module", r["name"]))
    data["docstrings.jsonl"] = _jsonl(doc_records)
    for name, content in data.items():
        _write_if_changed(dest / name, content)
    _remove_others(dest, set(data))
    return {
        "files": 2,
        "records": len(topic_records) + len(doc_records),
        "bytes": sum(len(c) for c in data.values()),
    }


# --------------------------------------------------------------------------- pkgdocs


def _dist_names() -> list[str]:
    from importlib import metadata

    metas = [d.metadata for d in metadata.distributions()]  # parsed once per distribution
    return sorted({f"{m['Name']}=={m['Version']}" for m in metas})


def _description(meta) -> str | None:  # noqa: ANN001 - an email.message.Message
    body = meta.get_payload() if hasattr(meta, "get_payload") else None
    text = body or meta.get("Description")
    return text if text and text.strip() and text.strip() != "UNKNOWN" else None


def build_pkgdocs(dest: Path, cap: int) -> dict[str, int]:
    """metadata.parquet: name, version, summary and the long description (text, null
    when a distribution has none) of every installed distribution, by name."""
    from importlib import metadata

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: dict[tuple[str, str], dict] = {}
    for dist in metadata.distributions():
        meta = dist.metadata  # each access re-reads and re-parses METADATA
        name, version = meta["Name"] or "", meta["Version"] or ""
        rows.setdefault(
            (name.lower(), version),
            {
                "name": name,
                "version": version,
                "summary": meta.get("Summary"),
                "text": _description(meta),
            },
        )
    records, total = [], 0
    for key in sorted(rows):
        size = len((rows[key]["text"] or "").encode())
        if total + size > cap:
            continue
        records.append(rows[key])
        total += size
    table = pa.Table.from_pylist(
        records,
        schema=pa.schema(
            [
                ("name", pa.string()),
                ("version", pa.string()),
                ("summary", pa.string()),
                ("text", pa.large_string()),
            ]
        ),
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    _write_if_changed(dest / "metadata.parquet", buf.getvalue())
    _remove_others(dest, {"metadata.parquet"})
    return {"files": 1, "records": len(records), "bytes": total}


# --------------------------------------------------------------------------- files


def _write_if_changed(path: Path, data: bytes) -> None:
    """Leave an identical file alone (its mtime too); otherwise write it atomically."""
    try:
        if path.stat().st_size == len(data) and path.read_bytes() == data:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _remove_others(dest: Path, keep: set[str]) -> None:
    """Delete files under `dest` that the current selection does not hold."""
    for path in sorted(dest.rglob("*"), reverse=True):
        rel = path.relative_to(dest).as_posix()
        if path.is_file() and rel not in keep:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def _read_stamp(out: Path) -> dict:
    try:
        return json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return {}


def prepare_demo(repo: str | Path = ".", max_mb: float = 6.0, progress=None):  # noqa: ANN001, ANN201
    """Build the demo corpus and prepare it: what `make demo` runs before training.
    Returns the `PrepResult` (up to date and instant when nothing changed)."""
    from trainlab.data.prep.pipeline import run_prep

    repo = Path(repo)
    build_demo_corpus(repo / DEMO_RAW, max_mb=max_mb)
    return run_prep(repo / DEMO_SOURCES, repo / DEMO_PREPARED, progress=progress)
