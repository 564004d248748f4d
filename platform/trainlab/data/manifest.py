"""Reading and verifying a prepared dataset (contract 2 in docs/contracts.md).

The loader trusts nothing it has not checked: the manifest's format, that every
listed shard exists with the rows the manifest says, and (optionally) each
shard's sha256. A problem is a `UserError` naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainlab.errors import UserError
from trainlab.location import Location, StorageError, locate

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
TOKEN_DTYPES = ("uint16", "uint32")  # TokenizerDoc.dtype


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

    location: Location  # a local directory, s3:// or gs://
    fingerprint: str
    eos_id: int
    vocab_size: int
    token_dtype: str
    sources: dict[str, SourceInfo]
    tokenizer_file: str = "tokenizer.json"
    tokenizer_sha256: str = ""

    @property
    def root(self) -> str:
        """The dataset's location for messages and records (absolute path or URI)."""
        return self.location.uri

    def shard_path(self, shard: Shard) -> str:
        """Where a shard is, for messages (read it with `location.open_input_file(shard.file)`)."""
        return self.location.uri_of(shard.file)


def repo_root() -> Path | None:
    """The checkout holding this package (editable install), if there is one."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").exists() else None


def resolve_dataset_dir(path: str | os.PathLike[str], what: str = "data.path") -> Location:
    """`data.path` as a dataset location holding a manifest: as given (a URI, an
    absolute path, a path relative to the working directory), else a relative path
    under the repo root (where recipes say it lives). One request for a store."""
    text = os.fspath(path)
    root = repo_root()
    candidates = list(
        dict.fromkeys(
            [locate(text, what=what), *([locate(text, what=what, base_dir=root)] if root else [])]
        )
    )
    for where in candidates:
        try:
            there = where.is_file(MANIFEST)
        except StorageError as e:  # the store could not be asked (endpoint, credentials)
            raise UserError(f"{what} = {text!r}: {where.unreachable(MANIFEST, e)}") from None
        if there:
            return where.resolved()
    tried = ", ".join(f"no {where.uri_of(MANIFEST)}" for where in candidates)
    raise UserError(
        f"{what} = {text!r}: no prepared dataset ({tried}); "
        f"run `trainlab prep SOURCES --out {candidates[0].uri}` first"
    )


# --------------------------------------------------------------------------- the file
# One declaration of manifest.json, for the writer (trainlab.data.prep.manifest)
# and the reader (load_manifest). Unknown keys are kept (a newer trainlab may add
# some); the known ones are typed and checked.


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ShardDoc(_Doc):
    file: str  # relative to the dataset directory
    rows: int = Field(ge=0)
    tokens: int = Field(ge=0)
    sha256: str


class RejectedDoc(_Doc):
    count: int = Field(ge=0)
    examples: list[str] = Field(default_factory=list)


class SourceDoc(_Doc):
    docs_in: int = Field(0, ge=0)
    docs_out: int = Field(ge=0)
    tokens: int = Field(ge=0)
    rejected: dict[str, RejectedDoc] = Field(default_factory=dict)
    shards: list[ShardDoc]

    @model_validator(mode="after")
    def _sums(self) -> SourceDoc:
        if (
            sum(s.rows for s in self.shards) != self.docs_out
            or sum(s.tokens for s in self.shards) != self.tokens
        ):
            raise ValueError(
                f"docs_out/tokens ({self.docs_out}/{self.tokens}) do not match the sum "
                "over its shards"
            )
        return self


class TokenizerDoc(_Doc):
    file: str = "tokenizer.json"
    sha256: str = ""
    vocab_size: int = Field(ge=1)
    eos_id: int = Field(ge=0)
    eos_token: str = ""
    dtype: Literal["uint16", "uint32"]


class ManifestDoc(_Doc):
    """manifest.json: contract 2 in docs/contracts.md."""

    format_version: int
    fingerprint: str
    tokenizer: TokenizerDoc
    cleaning: dict[str, Any] = Field(default_factory=dict)
    sources: dict[str, SourceDoc] = Field(min_length=1)
    input_signature: str | None = None

    @field_validator("format_version")
    @classmethod
    def _readable(cls, v: int) -> int:
        if v != FORMAT_VERSION:
            raise ValueError(f"this trainlab reads {FORMAT_VERSION}")
        return v

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def dataset_fingerprint(
    tokenizer_sha256: str, cleaning: dict, shards: list[tuple[str, str, str]]
) -> str:
    """The dataset's identity: the tokenizer's and every shard's checksum (source,
    file, sha256, in the manifest's order) and the cleaning settings. prep writes
    it; every reader recomputes it from what the manifest lists, so an edited
    manifest cannot keep the fingerprint of the data it no longer describes."""
    doc = {"tokenizer": tokenizer_sha256, "cleaning": cleaning, "shards": [list(s) for s in shards]}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(text).hexdigest()


def doc_fingerprint(doc: ManifestDoc) -> str:
    shards = [(n, s.file, s.sha256) for n, src in doc.sources.items() for s in src.shards]
    return dataset_fingerprint(doc.tokenizer.sha256, doc.cleaning, shards)


def parse_manifest(raw: Any, where: str) -> ManifestDoc:
    """`raw` (parsed JSON) as a ManifestDoc; UserError naming the first problem."""
    try:
        return ManifestDoc.model_validate(raw)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(x) for x in e["loc"])
        value = e.get("input")
        shown = f" = {value!r}" if not isinstance(value, dict | list) else ""
        message = e["msg"].removeprefix("Value error, ")
        raise UserError(f"{where}: {loc or '(top level)'}{shown}: {message}"[:500]) from None


def load_manifest(path: str | os.PathLike[str] | Location) -> Manifest:
    """Parse DIR/manifest.json (DIR a local directory or a store URI, or a manifest
    file's path); raise UserError if missing or malformed."""
    if isinstance(path, Location):
        where = path
    else:
        text = os.fspath(path).rstrip("/")
        if text.rsplit("/", 1)[-1] == MANIFEST:  # the manifest file itself
            text = text[: -len(MANIFEST)].rstrip("/") or "."
        where = locate(text, what="dataset").resolved()
    file = where.uri_of(MANIFEST)
    try:
        raw = json.loads(where.read_bytes(MANIFEST).decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"{file}: not found; run `trainlab prep` first") from None
    except StorageError as e:
        raise where.unreachable(MANIFEST, e) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{file}: cannot read manifest ({type(e).__name__}: {e})") from None
    doc = parse_manifest(raw, file)
    if doc_fingerprint(doc) != doc.fingerprint:
        raise UserError(
            f"{file}: its fingerprint does not match the tokenizer, cleaning and shard "
            "checksums it lists (the manifest was edited after prep); re-run `trainlab prep`"
        )
    sources = {
        name: SourceInfo(
            name=name,
            docs=src.docs_out,
            tokens=src.tokens,
            shards=tuple(Shard(s.file, s.rows, s.tokens, s.sha256) for s in src.shards),
        )
        for name, src in doc.sources.items()
    }
    return Manifest(
        location=where,
        fingerprint=doc.fingerprint,
        eos_id=doc.tokenizer.eos_id,
        vocab_size=doc.tokenizer.vocab_size,
        token_dtype=doc.tokenizer.dtype,
        sources=sources,
        tokenizer_file=doc.tokenizer.file,
        tokenizer_sha256=doc.tokenizer.sha256,
    )


def verify_shards(manifest: Manifest, checksums: bool = True) -> None:
    """Every shard exists, has (if `checksums`) its sha256 and the manifest's row count.

    A shard changed after prep would silently change the stream under an unchanged
    fingerprint; checking the checksums (about 1 GB/s locally; the whole dataset is
    downloaded once from a store) rules that out."""
    try:
        _verify_shards(manifest, checksums)
    except StorageError as e:  # the store could not be asked (endpoint, credentials)
        raise manifest.location.unreachable("", e) from None


def _verify_shards(manifest: Manifest, checksums: bool) -> None:
    where = manifest.location
    tok = manifest.tokenizer_file
    known = checksums and manifest.tokenizer_sha256 and where.is_file(tok)
    if known and sha256_of(where, tok) != manifest.tokenizer_sha256:
        raise UserError(
            f"{where.uri_of(tok)}: sha256 differs from the manifest; the prepared "
            "dataset was modified after prep (re-run `trainlab prep`)"
        )
    for src in manifest.sources.values():
        for shard in src.shards:
            path = manifest.shard_path(shard)
            if not where.is_file(shard.file):
                raise UserError(f"{path}: shard listed in {where.uri_of(MANIFEST)} is missing")
            if checksums and sha256_of(where, shard.file) != shard.sha256:
                raise UserError(
                    f"{path}: sha256 differs from the manifest; the prepared "
                    "dataset was modified after prep (re-run `trainlab prep`)"
                )
            rows = parquet_rows(where, shard.file)
            if rows != shard.rows:
                raise UserError(f"{path}: {rows} rows, manifest says {shard.rows}")


def sha256_of(where: Location, rel: str) -> str:
    """sha256 of a file of the dataset, read in 8 MB pieces."""
    import hashlib

    h = hashlib.sha256()
    try:
        with where.filesystem.open_input_stream(where.fs_path(rel)) as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    except OSError as e:
        raise where.unreachable(rel, e) from None
    return h.hexdigest()


def parquet_rows(where: Location, rel: str) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with where.open_input_file(rel) as f:
            return pq.ParquetFile(f).metadata.num_rows
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{where.uri_of(rel)}: not a readable Parquet shard ({e})") from None
