"""One way to reach a place: the only module that knows about storage schemes.

`locate` turns what a user wrote (a path, `s3://bucket/prefix`,
`gs://bucket/prefix`, `file:///path`) into a `Location`: a backend (this
machine's disk, S3, GCS) and a path inside it. Everything above holds a
`Location` and calls its operations (read, write atomically, append a record,
list, delete, size, upload, download) without asking where it is:

    runs = locate("s3://bucket/trainlab/runs", what="train.runs_root")
    runs.child("2026-12-06/tiny").write_json("plan.json", plan)

Adding a store is one backend file (trainlab.location.gcs is the example) and
its line in `SCHEMES`. Nothing here touches the network until a file is read.

Credentials never go in a location (it is recorded in config.yaml and MLflow):
each backend's SDK reads them from the environment (docs/security.md).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from urllib.parse import urlsplit

from trainlab.errors import UserError
from trainlab.location import gcs, s3
from trainlab.location.core import APPENDS_SUFFIX, Backend, Location
from trainlab.location.errors import (
    Absent,
    Conflict,
    Corrupt,
    StorageError,
    StoreUnavailable,
    Unavailable,
    read_retrying,
    storage_error,
)
from trainlab.location.local import LOCAL
from trainlab.redact import redact, url_credentials

__all__ = [
    "APPENDS_SUFFIX",
    "SETTINGS_ENV_VARS",
    "Absent",
    "Backend",
    "Conflict",
    "Corrupt",
    "Location",
    "StorageError",
    "StoreUnavailable",
    "Unavailable",
    "anchored",
    "check",
    "disk_only_problem",
    "form_problem",
    "local",
    "locate",
    "read_retrying",
    "storage_error",
]

# Scheme -> the backend module (imported on first use: pyarrow and each SDK's
# settings are not needed to validate a config).
SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
# The stores' settings that are no secret (endpoints, regions, projects): a run's
# driver forwards them to its workers and a submitted job to its driver.
# Credentials are never forwarded: each node has its own (docs/security.md).
SETTINGS_ENV_VARS = (*s3.SETTINGS_ENV_VARS, *gcs.SETTINGS_ENV_VARS)
SUPPORTED_FORMS = "a filesystem path, s3://bucket/prefix or gs://bucket/prefix"
CREDENTIALS_ELSEWHERE = (
    "credentials never go in a storage URL (it is recorded in config.yaml and MLflow "
    "params): give s3://bucket/prefix (or gs://) and set the store's own variables "
    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS, "
    "or an instance role) in each node's own environment"
)


def scheme_of(text: str) -> str:
    """The URI scheme of `text` ("" for a path; `file://` is a path)."""
    if "://" not in text:
        return ""
    scheme = urlsplit(text).scheme.lower()
    return "" if scheme == "file" else scheme


def credentials_problem(text: str) -> str | None:
    """Why `text` may not be used as storage because it carries credentials, or None."""
    return CREDENTIALS_ELSEWHERE if url_credentials(text) else None


def check(text: str, what: str) -> None:
    """A UserError naming `what` when `text` cannot be a location (an unknown
    scheme, credentials in it); no network access (config validation uses it)."""
    if credentials_problem(text):
        raise UserError(f"{what} = {redact(text)!r}: {CREDENTIALS_ELSEWHERE}")
    scheme = scheme_of(text)
    if scheme and scheme not in SCHEMES:
        raise UserError(
            f"{what} = {redact(text)!r}: unsupported scheme {scheme!r}; give {SUPPORTED_FORMS}"
        )


def form_problem(text: str, local: str) -> tuple[str, str] | None:
    """(the value as it may be shown, why) when `text` cannot name a location, a
    local path being `local` (said in the message); None when it can. No network
    access: config validation gathers these with the config's other problems."""
    scheme = scheme_of(text)
    if not scheme:
        return None
    rest = text.partition("://")[2]
    if credentials_problem(text):
        return redact(text), CREDENTIALS_ELSEWHERE
    if scheme not in SCHEMES:
        return text, (
            f"unsupported scheme {scheme!r}; give {local}, s3://bucket/prefix or gs://bucket/prefix"
        )
    if not rest.split("/")[0] or "?" in rest:
        return text, (
            f"expected {scheme}://bucket/prefix (the endpoint and credentials come from "
            "the store's environment variables, never the URI)"
        )
    return None


def disk_only_problem(text: str) -> str | None:
    """Why `text` cannot name a directory on each node's own disk (a URI), or None."""
    return "a local directory on each node, not a URI" if "://" in text else None


def anchored(value: str, anchor: str | os.PathLike[str]) -> str:
    """`value` as a config records it: a path made absolute (`~` expanded, relative
    to `anchor`, normalized); a URI as it is."""
    if "://" in value:
        return value
    p = Path(value).expanduser()
    return os.path.normpath(p if p.is_absolute() else Path(anchor) / p)


def local(path: str | os.PathLike[str]) -> Location:
    """A folder on this machine's disk (made absolute; not resolved through links)."""
    p = Path(os.fspath(path)).expanduser()
    return Location(LOCAL, os.path.normpath(p.absolute()))


def locate(
    where: str | os.PathLike[str] | Location,
    *,
    what: str = "storage",
    base_dir: str | os.PathLike[str] | None = None,
    no_anchor: str | None = None,
) -> Location:
    """The location `where` names: a path (relative to `base_dir`, default the
    current directory), `file://`, `s3://` or `gs://`. A bad value is a one-line
    UserError naming `what`; so is a relative path without `base_dir` when
    `no_anchor` says why there is none (the current directory is no anchor then)."""
    if isinstance(where, Location):
        return where
    text = os.fspath(where).strip()
    if not text:
        raise UserError(f"{what}: empty; give {SUPPORTED_FORMS}")
    check(text, what)
    scheme = scheme_of(text)
    if not scheme:
        path = Path(text.removeprefix("file://")).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        elif not path.is_absolute() and no_anchor is not None:
            raise UserError(f"{what} = {text!r}: relative, and {no_anchor}; give an absolute path")
        return local(path)
    parts = urlsplit(text)
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if not bucket:
        raise UserError(f"{what} = {redact(text)!r}: no bucket; expected {scheme}://bucket/prefix")
    if parts.query:
        raise UserError(
            f"{what} = {redact(text)!r}: options do not go in the URI; the store's "
            "endpoint and credentials come from its environment variables"
        )
    backend = _backend(SCHEMES[scheme], what)
    return Location(backend, f"{bucket}/{prefix}" if prefix else bucket)


def _backend(module: str, what: str) -> Backend:
    try:
        return importlib.import_module(f"trainlab.location.{module}").backend()
    except UserError as e:
        raise UserError(f"{what}: {e.lines[0]}") from None
