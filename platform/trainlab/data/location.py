"""Where a prepared dataset lives: a local directory or `s3://bucket/prefix`.

A dataset location the user gives (`data.path`, `trainlab prep --out`) is never
put through pathlib as it is: `s3://bucket/x` taken for a path is the relative
folder `s3:/bucket/x` (prep once created one in the working directory). Every
reader and writer goes through a `DatasetDir` instead, which names the file
system (pyarrow's local or S3 one, from `trainlab.storage`: endpoint and
credentials only from the AWS_* variables) and the path inside it.

    where = dataset_dir("s3://bucket/prepared", what="data.path")
    where.read_bytes("manifest.json")
    pq.read_table(where.join("code/part-00000.parquet"), filesystem=where.filesystem)

Other schemes (gs://, hdfs://, ...) are refused in one line naming the value and
the two supported forms. Nothing here touches the network until a file is read.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from trainlab.errors import UserError, first_line
from trainlab.redact import redact
from trainlab.storage import is_uri, resolve_storage

SUPPORTED_FORMS = "a local directory or s3://bucket/prefix"
SUPPORTED_SCHEMES = ("s3", "s3a", "file")


@dataclass(frozen=True)
class DatasetDir:
    """A dataset directory: `uri` for people and records (an absolute local path or
    s3://bucket/prefix), `path` inside `filesystem` (a pyarrow FileSystem, made on
    first use: a local manifest is read without importing pyarrow, so `validate`
    stays instant)."""

    uri: str
    path: str
    endpoint_url: str | None = None

    def __str__(self) -> str:
        return self.uri

    @functools.cached_property
    def filesystem(self) -> Any:
        if self.is_local:
            from pyarrow import fs

            return fs.LocalFileSystem()
        return resolve_storage(self.uri, endpoint_url=self.endpoint_url).filesystem

    @property
    def is_local(self) -> bool:
        return not is_uri(self.uri)

    def join(self, rel: str) -> str:
        """The path inside the filesystem of `rel`, a file name the dataset lists (a
        manifest's shard names come from a file anyone may have edited: no `..`,
        not absolute)."""
        parts = PurePosixPath(rel).parts
        if not rel or rel.startswith(("/", "~")) or ".." in parts or "\\" in rel:
            raise UserError(f"{self.uri}: file name {rel!r} leads outside the dataset")
        return "/".join([self.path.rstrip("/"), rel])

    def uri_of(self, rel: str) -> str:
        return "/".join([self.uri.rstrip("/"), rel])

    def local(self, rel: str = "") -> Path:
        """A local dataset's file as a Path (only for a local dataset)."""
        assert self.is_local, self.uri
        return Path(self.join(rel)) if rel else Path(self.path)

    def is_file(self, rel: str) -> bool:
        from pyarrow import fs

        if self.is_local:
            return os.path.isfile(self.join(rel))
        try:
            return self.filesystem.get_file_info(self.join(rel)).type == fs.FileType.File
        except OSError as e:
            raise self.unreachable(rel, e) from None

    def read_bytes(self, rel: str) -> bytes:
        """The whole file; FileNotFoundError when it is not there, UserError when the
        store cannot be read (unreachable endpoint, no permission)."""
        if self.is_local:
            with open(self.join(rel), "rb") as f:
                return f.read()
        try:
            with self.filesystem.open_input_stream(self.join(rel)) as f:
                return f.read()
        except FileNotFoundError:
            raise
        except OSError as e:
            if _not_found(e):
                raise FileNotFoundError(self.uri_of(rel)) from None
            raise self.unreachable(rel, e) from None

    def open(self, rel: str) -> Any:
        """A random-access file (Parquet reads only the byte ranges it needs)."""
        return self.filesystem.open_input_file(self.join(rel))

    def unreachable(self, rel: str, error: BaseException) -> UserError:
        where = f" (endpoint {redact(self.endpoint_url)})" if self.endpoint_url else ""
        return UserError(
            f"{self.uri_of(rel)}{where}: cannot read ({redact(first_line(error))}); "
            "check the AWS_* variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)"
        )


def _not_found(error: OSError) -> bool:
    """pyarrow's S3 filesystem reports a missing key as a plain OSError."""
    text = str(error)
    return "NoSuchKey" in text or "Path does not exist" in text or "NoSuchBucket" in text


def scheme_of(location: str) -> str:
    return urlsplit(location).scheme.lower() if is_uri(location) else ""


def check_location(location: str, what: str) -> None:
    """A UserError naming `what` when `location` is a URI of an unsupported scheme
    (no network access; config validation uses it)."""
    scheme = scheme_of(location)
    if scheme and scheme not in SUPPORTED_SCHEMES:
        raise UserError(
            f"{what} = {redact(location)!r}: unsupported scheme {scheme!r}; give "
            f"{SUPPORTED_FORMS}"
        )


def dataset_dir(location: str | os.PathLike[str], what: str = "data.path") -> DatasetDir:
    """`location` resolved (no network access): a URI through `trainlab.storage`, a
    local path made absolute against the current directory. A bad location is a
    UserError naming `what`."""
    text = os.fspath(location).strip()
    if not text:
        raise UserError(f"{what}: empty; give {SUPPORTED_FORMS}")
    check_location(text, what)
    if scheme_of(text) in ("", "file"):
        p = Path(text.removeprefix("file://")).expanduser().absolute()
        local = os.path.normpath(p)
        return DatasetDir(local, local)
    try:
        storage = resolve_storage(text)  # refuses credentials in the URI, a missing bucket
    except UserError as e:
        raise UserError(f"{what}: {e.lines[0]}") from None
    return DatasetDir(storage.uri, storage.path, storage.endpoint_url)
