"""Reading and verifying a prepared dataset (contract 2 in docs/contracts.md).

The loader trusts nothing it has not checked: the manifest's format, that every
listed shard exists with the rows the manifest says, and (optionally) each
shard's sha256. A problem is a `UserError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlab.errors import UserError
from trainlab.fileutil import sha256_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass(frozen=True)
class Shard:
    file: str  # relative to the dataset directory
    rows: int
    tokens: int
    sha256: str


@dataclass(frozen=True)
class SourceInfo:
    name: str
    docs: int
    tokens: int
    shards: tuple[Shard, ...]


@dataclass(frozen=True)
class Manifest:
    """What `trainlab prep` wrote, checked. `sources` keeps the sources-YAML order."""

    root: Path  # absolute dataset directory
    fingerprint: str
    eos_id: int
    vocab_size: int
    token_dtype: str
    sources: dict[str, SourceInfo]

    def shard_path(self, shard: Shard) -> Path:
        return self.root / shard.file


def repo_root() -> Path | None:
    """The checkout holding this package (editable install), if there is one."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").exists() else None


def resolve_dataset_dir(path: str | os.PathLike[str]) -> Path:
    """`data.path` as an absolute directory: as given when absolute, else relative to
    the working directory, else to the repo root (where recipes say it lives)."""
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p]
    root = repo_root()
    if not p.is_absolute() and root is not None and root != Path.cwd():
        candidates.append(root / p)
    for c in candidates:
        if (c / MANIFEST).is_file():
            return c.resolve()
    tried = ", ".join(str(c / MANIFEST) for c in candidates)
    raise UserError(
        f"data.path = {str(path)!r}: no prepared dataset (looked for {tried}); "
        "run `trainlab prep` first"
    )


def _field(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise UserError(f"{where}: missing key {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise UserError(f"{where}.{key} = {value!r}: wrong type")
    return value


def _parse_source(name: str, raw: Any, where: str) -> SourceInfo:
    if not isinstance(raw, dict):
        raise UserError(f"{where}: must be a mapping")
    shards = []
    for i, s in enumerate(_field(raw, "shards", list, where)):
        sw = f"{where}.shards[{i}]"
        if not isinstance(s, dict):
            raise UserError(f"{sw}: must be a mapping")
        shards.append(
            Shard(
                file=_field(s, "file", str, sw),
                rows=_field(s, "rows", int, sw),
                tokens=_field(s, "tokens", int, sw),
                sha256=_field(s, "sha256", str, sw),
            )
        )
    docs = _field(raw, "docs_out", int, where)
    tokens = _field(raw, "tokens", int, where)
    if sum(s.rows for s in shards) != docs or sum(s.tokens for s in shards) != tokens:
        raise UserError(
            f"{where}: docs_out/tokens ({docs}/{tokens}) do not match the sum over its shards"
        )
    return SourceInfo(name=name, docs=docs, tokens=tokens, shards=tuple(shards))


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Parse DIR/manifest.json (or a manifest file path); raise UserError if malformed."""
    p = Path(path)
    root = p.parent if p.name == MANIFEST else p
    file = root / MANIFEST
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{file}: not found; run `trainlab prep` first") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{file}: cannot read manifest ({type(e).__name__}: {e})") from None
    where = str(file)
    if not isinstance(raw, dict):
        raise UserError(f"{where}: top level must be an object")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise UserError(
            f"{where}: format_version = {version!r}; this trainlab reads {FORMAT_VERSION}"
        )
    tok = _field(raw, "tokenizer", dict, where)
    dtype = _field(tok, "dtype", str, f"{where}: tokenizer")
    if dtype not in TOKEN_DTYPES:
        raise UserError(f"{where}: tokenizer.dtype = {dtype!r}: must be one of {TOKEN_DTYPES}")
    sources_raw = _field(raw, "sources", dict, where)
    if not sources_raw:
        raise UserError(f"{where}: no sources")
    sources = {
        name: _parse_source(name, s, f"{where}: sources.{name}") for name, s in sources_raw.items()
    }
    return Manifest(
        root=root.resolve(),
        fingerprint=_field(raw, "fingerprint", str, where),
        eos_id=_field(tok, "eos_id", int, f"{where}: tokenizer"),
        vocab_size=_field(tok, "vocab_size", int, f"{where}: tokenizer"),
        token_dtype=dtype,
        sources=sources,
    )


def verify_shards(manifest: Manifest, checksums: bool = True) -> None:
    """Every shard exists, has (if `checksums`) its sha256 and the manifest's row count.

    A shard changed after prep would silently change the stream under an unchanged
    fingerprint; checking the checksums (about 1 GB/s) rules that out."""
    for src in manifest.sources.values():
        for shard in src.shards:
            path = manifest.shard_path(shard)
            if not path.is_file():
                raise UserError(f"{path}: shard listed in {manifest.root / MANIFEST} is missing")
            if checksums and sha256_file(path) != shard.sha256:
                raise UserError(
                    f"{path}: sha256 differs from the manifest; the prepared "
                    "dataset was modified after prep (re-run `trainlab prep`)"
                )
            rows = parquet_rows(path)
            if rows != shard.rows:
                raise UserError(f"{path}: {rows} rows, manifest says {shard.rows}")


def parquet_rows(path: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable Parquet shard ({e})") from None
