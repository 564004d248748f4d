"""Where runs and checkpoints live: a local or shared filesystem path, or S3.

A multi-node run needs storage that every node reaches: a shared filesystem
mounted at the same path on every node (NFS, Lustre, EFS...) or an
S3-compatible bucket. `resolve_storage` turns what the user wrote into what
Ray Train's `RunConfig` takes:

    storage = resolve_storage("s3://bucket/trainlab/runs")
    RunConfig(name=..., **storage.run_config_kwargs())

S3-compatible servers (MinIO, Ceph, a local test server) are reached through an
endpoint override: the `endpoint_url` argument, else the standard AWS variables
`AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`. Credentials are never part of a
URI or a config: the AWS SDK reads them from the environment
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`) or the
node's instance role. A location with credentials in it is refused, with a
message saying where they go instead (docs/security.md).

Also here, for everything that writes below a location:

- `resolve_inside(root, name)`: a name read from storage, a manifest or a
  checkpoint's metadata, as a path that stays inside `root` (no `..`, not
  absolute, no symlink leading out), else `UnsafePath`.
- `check_disk_room(run_dir, checkpoint_cfg, num_params)`: the preflight before
  a run starts: the run directory's filesystem holds keep_last + keep_best + 1
  checkpoints of the planned size, else a `UserError` with the numbers.

Storage errors have kinds (`storage_error`): *absent* (the object or file is not
there), *corrupt* (it is there and does not parse or match its checksum) and
*unavailable* (timeouts, 5xx, throttling, refused connections: it may be there).
Only absent or corrupt may make a checkpoint invalid; nothing is ever deleted
on a read that did not succeed. `read_retrying` retries an unavailable read with
backoff, as S3 clients do, then raises `StoreUnavailable`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

from trainlab.errors import UserError, first_line
from trainlab.exitcodes import STORAGE_FAULT
from trainlab.redact import redact, url_credentials

log = logging.getLogger(__name__)
T = TypeVar("T")

ENDPOINT_ENV_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
REGION_ENV_VARS = ("AWS_REGION", "AWS_DEFAULT_REGION")
# With an endpoint override the region is only a signing parameter; S3-compatible
# servers accept the SDK's default one.
DEFAULT_REGION = "us-east-1"
# Where credentials go instead of a URL (a URL is recorded in config.yaml and MLflow).
CREDENTIALS_ELSEWHERE = (
    "credentials never go in a storage URL (it is recorded in config.yaml and MLflow "
    "params): give s3://bucket/prefix and set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
    "(or AWS_PROFILE, or an instance role) in each node's own environment"
)


def is_uri(location: str | os.PathLike[str]) -> bool:
    """True for `scheme://...` (s3://, gs://, file://): never taken for a local path."""
    text = os.fspath(location)
    return "://" in text and bool(urlsplit(text).scheme)


SCRATCH_ENV_VAR = "TRAINLAB_SCRATCH_DIR"


def scratch_root(configured: str | None = None) -> Path:
    """This node's scratch and cache area: `resource.scratch_dir`, else
    $TRAINLAB_SCRATCH_DIR, else {the node's temp dir}/trainlab-scratch (TMPDIR
    decides the temp dir, so raylets started with their own TMPDIR get their own
    scratch). Created on first use. Nothing here is the only copy of anything."""
    import tempfile

    text = configured or os.environ.get(SCRATCH_ENV_VAR)
    root = Path(text).expanduser() if text else Path(tempfile.gettempdir()) / "trainlab-scratch"
    root.mkdir(parents=True, exist_ok=True)
    return root


def credentials_problem(location: str) -> str | None:
    """Why `location` may not be used as storage because it carries credentials
    (the CREDENTIALS_ELSEWHERE message), or None."""
    return CREDENTIALS_ELSEWHERE if url_credentials(location) else None


@dataclass(frozen=True)
class Storage:
    """A resolved storage location.

    `uri`: normalized, for people and records (absolute path or s3://bucket/prefix).
    `path`: the location inside `filesystem` (absolute path, or bucket/prefix).
    """

    kind: Literal["local", "s3"]
    uri: str
    path: str
    filesystem: Any  # pyarrow.fs.FileSystem; Any keeps this module import-light
    endpoint_url: str | None = None

    @property
    def is_shared(self) -> bool:
        """True when other machines can reach it without a shared mount (S3)."""
        return self.kind == "s3"

    def join(self, *parts: str) -> str:
        """A path inside the filesystem below this location."""
        return "/".join([self.path.rstrip("/"), *(p.strip("/") for p in parts)])

    def uri_of(self, *parts: str) -> str:
        """The URI of a location below this one (for records and messages)."""
        return "/".join([self.uri.rstrip("/"), *(p.strip("/") for p in parts)])

    def run_config_kwargs(self) -> dict[str, Any]:
        """`storage_path` and `storage_filesystem` for `ray.train.RunConfig`."""
        return {"storage_path": self.path, "storage_filesystem": self.filesystem}


def resolve_storage(
    location: str | os.PathLike[str],
    *,
    base_dir: str | Path | None = None,
    endpoint_url: str | None = None,
) -> Storage:
    """Resolve a path or `s3://bucket/prefix` URI (no network access).

    A relative path is taken relative to `base_dir` (default: the current
    directory). Other URI schemes are refused with a message naming the two
    supported forms.
    """
    text = os.fspath(location).strip()
    if not text:
        raise UserError("storage location is empty: give a path or s3://bucket/prefix")
    if credentials_problem(text):
        raise UserError(f"storage {redact(text)!r}: {CREDENTIALS_ELSEWHERE}")
    scheme = urlsplit(text).scheme.lower() if "://" in text else ""
    if scheme in ("", "file"):
        return _local(text.removeprefix("file://"), base_dir)
    if scheme in ("s3", "s3a"):
        return _s3(text, endpoint_url)
    raise UserError(
        f"storage {redact(text)!r}: unsupported scheme {scheme!r}; use a filesystem "
        "path (shared by every node for multi-node runs) or s3://bucket/prefix"
    )


def _local(path: str, base_dir: str | Path | None) -> Storage:
    from pyarrow import fs

    p = Path(path).expanduser()
    if not p.is_absolute():
        p = Path(base_dir or Path.cwd()) / p
    p = Path(os.path.normpath(p))
    return Storage(kind="local", uri=str(p), path=str(p), filesystem=fs.LocalFileSystem())


def s3_endpoint(endpoint_url: str | None = None) -> str | None:
    """The S3 endpoint override: the argument, else AWS_ENDPOINT_URL_S3/AWS_ENDPOINT_URL."""
    if endpoint_url:
        return endpoint_url
    for var in ENDPOINT_ENV_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


def _s3(uri: str, endpoint_url: str | None) -> Storage:
    from pyarrow import fs

    parts = urlsplit(uri)
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if not bucket:
        raise UserError(f"storage {redact(uri)!r}: no bucket; expected s3://bucket/prefix")
    if parts.query:
        raise UserError(
            f"storage {redact(uri)!r}: options do not go in the URI; set the endpoint "
            "with AWS_ENDPOINT_URL and credentials with AWS_* variables"
        )
    endpoint = s3_endpoint(endpoint_url)
    region = next((os.environ[v] for v in REGION_ENV_VARS if os.environ.get(v)), None)
    kwargs: dict[str, Any] = {"region": region or DEFAULT_REGION}
    if endpoint:
        ep = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        if ep.scheme not in ("http", "https") or not ep.netloc:
            raise UserError(f"S3 endpoint {redact(endpoint)!r}: expected http(s)://host:port")
        kwargs.update(endpoint_override=ep.netloc, scheme=ep.scheme)
    path = f"{bucket}/{prefix}" if prefix else bucket
    return Storage(
        kind="s3",
        uri=f"s3://{path}",
        path=path,
        filesystem=fs.S3FileSystem(**kwargs),
        endpoint_url=endpoint,
    )


def check_writable(storage: Storage) -> None:
    """Write, read back and delete a small probe file; raise UserError naming the
    location and the cause when any step fails (missing bucket, no permission,
    unreachable endpoint, read-only mount)."""
    probe = storage.join(f".trainlab-probe-{uuid.uuid4().hex}")
    payload = b"trainlab storage probe"
    fs = storage.filesystem
    try:
        if storage.kind == "local":
            fs.create_dir(storage.path, recursive=True)
        with fs.open_output_stream(probe) as out:
            out.write(payload)
        with fs.open_input_stream(probe) as inp:
            back = inp.read()
        fs.delete_file(probe)
    except (OSError, ValueError) as e:  # pyarrow raises OSError subclasses
        where = f" (endpoint {redact(storage.endpoint_url)})" if storage.endpoint_url else ""
        first = redact(first_line(e))
        raise UserError(f"storage {storage.uri}{where} is not writable: {first}") from None
    if back != payload:
        raise UserError(f"storage {storage.uri}: a probe file read back differently")


# --------------------------------------------------------------------------- names


# --------------------------------------------------------------------------- error kinds


class StorageError(OSError):
    """A read or write of storage that did not succeed, with its kind."""

    kind = "unavailable"


class Absent(StorageError):
    """The object or file is not there."""

    kind = "absent"


class Corrupt(StorageError):
    """It is there, and does not parse or does not match its checksum."""

    kind = "corrupt"


class Unavailable(StorageError):
    """Storage did not answer as it should (timeout, 5xx, throttling, a refused
    connection): the object may well be there."""

    kind = "unavailable"


class StoreUnavailable(UserError):
    """Storage stayed unavailable through every retry: the command stops, nothing
    was changed (exit 74, the storage code; run it again when the store answers)."""

    exit_code = STORAGE_FAULT


# How pyarrow's filesystems (and the SDKs below them) say "not there".
_ABSENT_MARKS = ("path does not exist", "nosuchkey", "no such key", "not found", "404",
                 "no such file", "does not exist")  # fmt: skip


def storage_error(err: BaseException, what: str) -> StorageError:
    """`err`, raised while reading or writing `what`, as a storage error of its kind."""
    if isinstance(err, StorageError):
        return err
    text = first_line(str(err)) or type(err).__name__
    if isinstance(err, FileNotFoundError):
        return Absent(f"{what}: not there")
    if isinstance(err, ValueError | UnicodeDecodeError | json.JSONDecodeError):
        return Corrupt(f"{what}: {text}")
    lowered = text.lower()
    if isinstance(err, OSError) and any(m in lowered for m in _ABSENT_MARKS):
        return Absent(f"{what}: not there ({text})")
    return Unavailable(f"{what}: {text}")


# Retries of an unavailable read: delays in seconds (about 30 s in all), or
# TRAINLAB_STORE_RETRY_S seconds in all when set (tests shorten it).
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)


def _retry_delays() -> tuple[float, ...]:
    total = os.environ.get("TRAINLAB_STORE_RETRY_S")
    if total is None:
        return RETRY_DELAYS
    scale = float(total) / sum(RETRY_DELAYS)
    return tuple(d * scale for d in RETRY_DELAYS)


def read_retrying(read: Callable[[], T], what: str) -> T:
    """`read()`, retried with backoff while storage is unavailable; an absent or
    corrupt result raises its kind at once (`Absent`, `Corrupt`), and storage that
    stays unavailable raises `StoreUnavailable` naming what could not be read."""
    delays = _retry_delays()
    for attempt in range(len(delays) + 1):
        try:
            return read()
        except Exception as err:  # noqa: BLE001 - classified below
            kind = storage_error(err, what)
            if not isinstance(kind, Unavailable):
                raise kind from err
            if attempt == len(delays):
                raise StoreUnavailable(
                    f"{kind}: storage unavailable through {attempt + 1} tries over "
                    f"{sum(delays):.0f} s; nothing was changed: run the command again when "
                    "it answers"
                ) from err
            log.warning("%s (try %d; retrying in %.1f s)", kind, attempt + 1, delays[attempt])
            time.sleep(delays[attempt])
    raise AssertionError("unreachable")


class UnsafePath(ValueError):
    """A name read from storage, a manifest or a checkpoint leads outside its root."""


def resolve_inside(root: str | os.PathLike[str], name: object, what: str = "name") -> Path:
    """`root / name` for a `name` written by someone else (a storage copy's
    checkpoint.json, a manifest): a non-empty relative POSIX path without `..`
    whose resolved location, symlinks followed, stays inside `root`'s. Raises
    `UnsafePath` naming `what` and the name otherwise."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise UnsafePath(f"{what} {name!r} is not a plain relative file name")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts or name.startswith("~"):
        raise UnsafePath(f"{what} {name!r} leads outside {root}")
    base = Path(root)
    target = base.joinpath(*parts)
    real_root, real = base.resolve(), target.resolve()
    if real != real_root and real_root not in real.parents:
        raise UnsafePath(f"{what} {name!r} leads outside {root} (through a symlink, to {real})")
    return target


# --------------------------------------------------------------------------- disk room

# A checkpoint holds the fp32 weights and the optimizer's state (AdamW: two fp32
# moments, 12 bytes per parameter in all; each optimizer states its figure,
# trainlab.optim) plus the trainer state and every rank's RNG (well under this
# allowance).
CHECKPOINT_BYTES_PER_PARAM = 12  # AdamW's: the default when no figure is given
CHECKPOINT_OVERHEAD_BYTES = 1 << 20


def planned_checkpoint_bytes(
    num_params: int, bytes_per_param: float = CHECKPOINT_BYTES_PER_PARAM
) -> int:
    """The size on disk of one checkpoint of a model with `num_params` parameters."""
    return int(bytes_per_param * int(num_params)) + CHECKPOINT_OVERHEAD_BYTES


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _existing_dir(path: Path) -> Path:
    for d in (path, *path.parents):
        if d.is_dir():
            return d
    return Path(path.anchor or "/")


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_disk_room(
    run_dir: str | os.PathLike[str],
    checkpoint_cfg: Any,
    num_params: int,
    bytes_per_param: float = CHECKPOINT_BYTES_PER_PARAM,
) -> None:
    """Refuse to start a run whose directory's filesystem cannot hold
    `keep_last + keep_best + 1` checkpoints (the retained ones and the one being
    written) of the planned size; the checkpoints already in the run directory
    count as room taken. `checkpoint_cfg`: the config's `train.checkpoint`."""
    run_dir = Path(run_dir)
    keep_last, keep_best = int(checkpoint_cfg.keep_last), int(checkpoint_cfg.keep_best)
    count = keep_last + keep_best + 1
    size = planned_checkpoint_bytes(num_params, bytes_per_param)
    ckpts = run_dir / "checkpoints"
    have = _tree_bytes(ckpts) if ckpts.is_dir() else 0
    need = max(0, count * size - have)
    where = _existing_dir(run_dir)
    free = shutil.disk_usage(where).free
    if need <= free:
        return
    raise UserError(
        f"train.runs_root: the filesystem of {run_dir} (at {where}) has {gib(free)} free; "
        f"{count} checkpoints (train.checkpoint.keep_last {keep_last} + keep_best "
        f"{keep_best} + 1 being written) of {gib(size)} each ({num_params:,} parameters x "
        f"{bytes_per_param:.4g} bytes) need {gib(need)} more"
        + (f" (besides the {gib(have)} of checkpoints already there)" if have else "")
        + "; free space, lower keep_last/keep_best or set train.runs_root to a larger disk"
    )
