"""`Location`: a place (a folder or an object prefix) on one backend, and the
few operations trainlab needs there; `Backend`: how one kind of storage does
them.

A backend is a pyarrow filesystem plus what differs between kinds of storage
for real:

- *atomic replace*: a local file is written beside its name and renamed; an
  object store's PUT is atomic by itself;
- *append*: a local file takes O_APPEND writes of whole lines from several
  processes; an object store has no append, so an appended "file" there is a
  folder of one object per append (`{name}.d/{time_ns}-{random}.jsonl`), read
  back in name order: appends from different nodes never overwrite each other;
- *folders*: a local folder exists by itself; in an object store a "folder" is
  there when an object below it is.

Every other operation is the same code on every backend. Errors come out with
their kind (trainlab.location.errors): `Absent`, `Corrupt`, `Unavailable`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from trainlab.errors import UserError, first_line
from trainlab.location.errors import Absent, StorageError, storage_error
from trainlab.redact import redact

APPENDS_SUFFIX = ".d"


class Backend:
    """One kind of storage. Subclasses set `scheme` ("" for the local disk) and make
    the pyarrow filesystem; the local disk overrides the operations it does faster
    or differently (trainlab.location.local)."""

    scheme: str = ""
    local: bool = False
    # What to check when the storage cannot be reached (said in errors).
    settings_hint: str = ""
    # How often a file polled for a change is worth reading again (seconds): a
    # request to an object store costs a round trip and money, a local read neither.
    poll_interval_s: float = 0.5

    def make_filesystem(self) -> Any:  # pragma: no cover - each backend has its own
        raise NotImplementedError

    @functools.cached_property
    def filesystem(self) -> Any:
        """The pyarrow filesystem (made on first use: pyarrow is not imported to
        validate a config)."""
        return self.make_filesystem()

    def uri(self, path: str) -> str:
        return f"{self.scheme}://{path}"

    def describe(self) -> str:
        """Where requests go, for messages (an endpoint override), or ""."""
        return ""

    # -------------------------------------------------------- what differs by kind

    def read(self, path: str) -> bytes:
        with self.filesystem.open_input_stream(path) as f:
            return f.read()

    def write_atomic(self, path: str, data: bytes) -> None:
        with self.filesystem.open_output_stream(path) as out:  # one PUT: atomic
            out.write(data)

    def append(self, path: str, text: str) -> None:
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.jsonl"
        self.write_atomic(f"{path}{APPENDS_SUFFIX}/{name}", text.encode())

    def read_appended(self, path: str) -> str:
        folder = f"{path}{APPENDS_SUFFIX}"
        parts = []
        for name in self.list(folder):
            with contextlib.suppress(FileNotFoundError):
                parts.append(self.read(f"{folder}/{name}").decode(errors="replace"))
        return "".join(parts)

    def exists(self, path: str) -> bool:
        from pyarrow import fs

        if self.filesystem.get_file_info(path).type != fs.FileType.NotFound:
            return True
        return bool(self.list(path))  # no empty folders: one with objects exists

    def make_dirs(self, path: str) -> None:
        """Nothing to do: an object store has no folders."""

    def nearest_folder(self, path: str) -> str:
        """`path` or its nearest ancestor that exists: in an object store a folder
        is there as soon as an object is put below it."""
        return path

    # Conditional writes (compare-and-swap on one object: the run lease). A backend
    # that has them sets `conditional` and implements the two below.
    conditional: bool = False

    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        """The object and its version (an ETag), or None when it is not there."""
        raise NotImplementedError(f"{self.scheme or 'file'}: no conditional writes")

    def write_if(self, path: str, data: bytes, version: str | None) -> str:
        """Write the object only if it is at `version` (None: only if it is not
        there); its new version, else `Conflict`."""
        raise NotImplementedError(f"{self.scheme or 'file'}: no conditional writes")

    # -------------------------------------------------------- the same everywhere

    def list(self, path: str) -> list[str]:
        from pyarrow import fs

        try:
            entries = self.filesystem.get_file_info(fs.FileSelector(path, allow_not_found=True))
        except FileNotFoundError:
            return []
        return sorted(e.base_name for e in entries)

    def walk(self, path: str) -> list[tuple[str, int]]:
        from pyarrow import fs

        sel = fs.FileSelector(path, recursive=True, allow_not_found=True)
        base = path.rstrip("/") + "/"
        return sorted(
            (e.path.removeprefix(base), int(e.size or 0))
            for e in self.filesystem.get_file_info(sel)
            if e.type == fs.FileType.File
        )

    def files(self, path: str) -> list[tuple[str, int, float]]:
        from pyarrow import fs

        sel = fs.FileSelector(path, recursive=True, allow_not_found=True)
        base = path.rstrip("/") + "/"
        return sorted(
            (e.path.removeprefix(base), int(e.size or 0), e.mtime.timestamp() if e.mtime else 0.0)
            for e in self.filesystem.get_file_info(sel)
            if e.type == fs.FileType.File
        )

    def files_below(self, path: str) -> tuple[list[Any], list[str]]:
        """The files below the folder `path` (each with `.path`, `.size`,
        `.mtime_ns`), names starting with "." skipped at any depth, and the
        symbolic links not followed (an object store has none)."""
        from pyarrow import fs

        base = path.rstrip("/") + "/"
        return [
            i
            for i in self.filesystem.get_file_info(fs.FileSelector(path, recursive=True))
            if i.type == fs.FileType.File
            and not any(part.startswith(".") for part in i.path.removeprefix(base).split("/"))
        ], []

    def is_link(self, path: str) -> bool:
        """An object store has no symbolic links."""
        return False

    def file_size(self, path: str) -> int | None:
        from pyarrow import fs

        info = self.filesystem.get_file_info(path)
        return int(info.size or 0) if info.type == fs.FileType.File else None

    def modified(self, path: str) -> float | None:
        from pyarrow import fs

        info = self.filesystem.get_file_info(path)
        if info.type == fs.FileType.NotFound or info.mtime is None:
            return None
        return info.mtime.timestamp()

    def delete_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filesystem.delete_file(path)

    def free_bytes(self, path: str) -> float:
        """Room left for writes below `path`: an object store has no disk to fill."""
        return math.inf

    def lease(self, place: Location, on_lost: Callable[[str, Any], None]) -> Any:
        """The lease of `place`: in a store, its record is the lease."""
        from trainlab.location.lease import StoreLease

        return StoreLease.take(place, on_lost)

    def kept_still(self, place: Location) -> AbstractContextManager[str | None]:
        from trainlab.location.lease import store_kept_still

        return store_kept_still(place)

    def reserve(self, path: str, size: int) -> bool:
        """Hold `size` bytes at `path` for writes that must succeed when the disk
        is full: nothing to hold in an object store."""
        return True

    def release(self, path: str) -> None:
        """Give back what `reserve` held."""

    def delete_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filesystem.delete_dir(path)

    def upload(self, src: Path, path: str) -> str:
        """Copy a local file to `path`; returns its sha256 (hashed on the way)."""
        h = hashlib.sha256()
        with open(src, "rb") as f, self.filesystem.open_output_stream(path) as out:
            while chunk := f.read(8 << 20):
                h.update(chunk)
                out.write(chunk)
        return h.hexdigest()

    def download(self, path: str, dst: Path) -> None:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.part-{uuid.uuid4().hex[:8]}")
        try:
            with self.filesystem.open_input_stream(path) as f, open(tmp, "wb") as out:
                shutil.copyfileobj(f, out, 8 << 20)
            tmp.replace(dst)
        finally:
            tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class Location:
    """A folder (or object prefix) on a backend. `path` is inside the backend's
    filesystem: an absolute local path, or `bucket/prefix`. `uri` names it for
    people and records (the local path itself, or `s3://bucket/prefix`).

    Names below it (`rel`) are relative POSIX paths; one read from a file someone
    else wrote (a manifest's shard names) is checked by `child`/`fs_path`: no
    `..`, not absolute."""

    backend: Backend
    path: str

    # ------------------------------------------------------------------ naming

    @property
    def uri(self) -> str:
        return self.backend.uri(self.path)

    def __str__(self) -> str:
        return self.uri

    @property
    def is_local(self) -> bool:
        """True for this machine's disk (a local or shared mount)."""
        return self.backend.local

    @property
    def poll_interval_s(self) -> float:
        """How often a file here polled for a change is worth reading again."""
        return self.backend.poll_interval_s

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        head = self.path.rstrip("/").rsplit("/", 1)[0]
        return Location(self.backend, head or "/")

    @property
    def filesystem(self) -> Any:
        """The pyarrow filesystem (for pyarrow readers and Ray Train's RunConfig)."""
        return self.backend.filesystem

    def fs_path(self, rel: str = "") -> str:
        """The path inside the filesystem of `rel`, a name below this location."""
        if not rel:
            return self.path
        parts = PurePosixPath(rel).parts
        if rel.startswith(("/", "~")) or ".." in parts or "\\" in rel or "\x00" in rel:
            raise UserError(f"{self.uri}: name {rel!r} leads outside it")
        return "/".join([self.path.rstrip("/"), rel.strip("/")])

    def uri_of(self, rel: str = "") -> str:
        return self.backend.uri(self.fs_path(rel))

    def child(self, rel: str) -> Location:
        return Location(self.backend, self.fs_path(rel))

    def __truediv__(self, rel: str) -> Location:
        return self.child(rel)

    def local_path(self, rel: str = "") -> Path:
        """`rel` as a Path: only for a location on this machine's disk."""
        if not self.is_local:
            raise ValueError(f"{self.uri} is not on this machine's disk")
        return Path(self.fs_path(rel))

    def resolved(self) -> Location:
        """The same place with a local path's symlinks resolved (a store has none)."""
        if not self.is_local:
            return self
        import os

        return Location(self.backend, os.path.realpath(self.path))

    def below(self, folder: str | Path) -> str | None:
        """Where this location lies below `folder` on this machine's disk, as a
        POSIX path ("." for the folder itself; symlinks resolved), or None: it lies
        elsewhere, or in an object store."""
        if not self.is_local:
            return None
        import os

        try:
            rel = Path(os.path.realpath(self.path)).relative_to(Path(folder).resolve())
        except ValueError:
            return None
        return rel.as_posix()

    def describe(self) -> str:
        """The URI, with the endpoint requests go to when one is set."""
        extra = self.backend.describe()
        return f"{self.uri}{f' ({extra})' if extra else ''}"

    # ------------------------------------------------------------------ reads

    @contextlib.contextmanager
    def _kinds(self, rel: str) -> Iterator[None]:
        """Any failure below as a storage error of its kind, naming the URI."""
        try:
            yield
        except StorageError:
            raise
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - classified
            raise storage_error(err, self.uri_of(rel)) from err

    def read_bytes(self, rel: str = "") -> bytes:
        """The whole file; `Absent` when it is not there, `Unavailable` when the
        storage did not answer."""
        with self._kinds(rel):
            return self.backend.read(self.fs_path(rel))

    def read_or_none(self, rel: str = "") -> bytes | None:
        """The whole file, or None when it is not there (other failures raise)."""
        try:
            return self.read_bytes(rel)
        except Absent:
            return None

    def read_text(self, rel: str = "") -> str | None:
        """The file's text, or None when it is not there."""
        data = self.read_or_none(rel)
        return None if data is None else data.decode()

    def read_json(self, rel: str = "") -> Any:
        """The parsed file; `Absent` or `Corrupt` (it does not parse) otherwise."""
        data = self.read_bytes(rel)
        with self._kinds(rel):
            return json.loads(data)

    def open_input_file(self, rel: str = "") -> Any:
        """A random-access file (Parquet reads only the byte ranges it needs)."""
        with self._kinds(rel):
            return self.filesystem.open_input_file(self.fs_path(rel))

    def exists(self, rel: str = "") -> bool:
        with self._kinds(rel):
            return self.backend.exists(self.fs_path(rel))

    def exists_offline(self, rel: str = "") -> bool | None:
        """Whether `rel` exists, where that is known without a request (this
        machine's disk); None where only a request to a store could tell (config
        validation stays instant and works offline)."""
        return self.exists(rel) if self.is_local else None

    def is_file(self, rel: str) -> bool:
        return self.size(rel) is not None

    def size(self, rel: str) -> int | None:
        """The file's size in bytes, or None when there is no file."""
        with self._kinds(rel):
            return self.backend.file_size(self.fs_path(rel))

    def modified(self, rel: str = "") -> float | None:
        """When the file (or a local folder) was last written (seconds since the
        epoch), or None when it is not there."""
        with self._kinds(rel):
            return self.backend.modified(self.fs_path(rel))

    def list(self, rel: str = "") -> list[str]:
        """Names directly inside folder `rel` (sorted; [] when there is none)."""
        with self._kinds(rel):
            return self.backend.list(self.fs_path(rel))

    def walk(self, rel: str = "") -> list[tuple[str, int]]:
        """Every file below `rel`: (name relative to `rel`, size), sorted."""
        with self._kinds(rel):
            return self.backend.walk(self.fs_path(rel))

    def files(self, rel: str = "") -> list[tuple[str, int, float]]:
        """Every file below `rel`: (name relative to `rel`, size, modified time),
        sorted; on a disk, symbolic links are neither listed nor followed."""
        with self._kinds(rel):
            return self.backend.files(self.fs_path(rel))

    def files_below(self) -> tuple[list[Any], list[str]]:
        """The files to read below this folder: each with `.path` (inside the
        filesystem), `.size` and `.mtime_ns`; names starting with "." skipped at any
        depth, as a shell glob would. A folder on a disk is walked without leaving
        it: the second list names the symbolic links below it not followed, those
        leading outside it or looping (an object store has no links)."""
        return self.backend.files_below(self.path)

    def is_link(self, rel: str) -> bool:
        """`rel` is a symbolic link (on a disk; never followed by a deletion)."""
        with self._kinds(rel):
            return self.backend.is_link(self.fs_path(rel))

    def is_empty(self) -> bool:
        return not self.list()

    # ------------------------------------------------------------------ writes

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write the whole file at once: a reader sees the old or the new content."""
        with self._kinds(rel):
            path = self.fs_path(rel)
            self.backend.make_dirs(path.rsplit("/", 1)[0])
            self.backend.write_atomic(path, data)

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    @property
    def conditional_writes(self) -> bool:
        """Whether this storage can write an object only if it is at a version
        (S3's If-None-Match / If-Match): `read_versioned` and `write_if`."""
        return self.backend.conditional

    def read_versioned(self, rel: str) -> tuple[bytes, str] | None:
        """The file and its version, or None when it is not there."""
        with self._kinds(rel):
            return self.backend.read_versioned(self.fs_path(rel))

    def write_if(self, rel: str, data: bytes, version: str | None) -> str:
        """Write the file only if it is still at `version` (None: only if it is not
        there), in one request however slow: `Conflict` when another writer came
        first. Its new version otherwise."""
        with self._kinds(rel):
            return self.backend.write_if(self.fs_path(rel), data, version)

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())

    def make_dirs(self, rel: str = "") -> None:
        with self._kinds(rel):
            self.backend.make_dirs(self.fs_path(rel))

    def free_bytes(self) -> float:
        """Bytes that writes below this location may still take: what the disk
        holding it (its nearest existing folder) has free; `math.inf` for an
        object store, which has no disk to fill."""
        with self._kinds(""):
            return self.backend.free_bytes(self.path)

    def lease(self, on_lost: Callable[[str, Any], None]) -> Any:
        """Take this location's lease (trainlab.location.lease): one holder at a time,
        this process until it releases it or ends; `lease.previous` names a gone
        holder it was taken over from. A live holder: `lease.Held`. `on_lost`:
        called with (uri, new holder) when a beat of a lease in a store finds that
        another took it over."""
        return self.backend.lease(self, on_lost)

    def kept_still(self) -> AbstractContextManager[str | None]:
        """A moment in which nobody takes this location's lease: yields None when
        nobody holds it (on a disk its lock is held meanwhile; a store has no lock
        to hold: its lease is read), else who does ("pid N on host H since T")."""
        return self.backend.kept_still(self)

    def reserve(self, rel: str, size: int) -> bool:
        """Hold `size` bytes of this location's disk in file `rel`, for writes that
        must succeed once the disk is full (a run's last records: `release` frees
        them first); False when there is not even that much room (nothing held).
        An object store has no disk to fill: nothing to hold, True."""
        return self.backend.reserve(self.fs_path(rel), size)

    def release(self, rel: str) -> None:
        """Free the room `reserve` held (never raises)."""
        with contextlib.suppress(OSError):
            self.backend.release(self.fs_path(rel))

    def delete(self, rel: str) -> None:
        """Delete a file (no error when it is not there)."""
        with self._kinds(rel):
            self.backend.delete_file(self.fs_path(rel))

    def delete_tree(self, rel: str = "") -> None:
        """Delete a folder and everything below it (no error when it is not there)."""
        with self._kinds(rel):
            self.backend.delete_tree(self.fs_path(rel))

    def remove_if_empty(self, rel: str = "") -> None:
        """Remove folder `rel` if nothing is in it; an object store has no empty
        folders (a prefix exists by its objects): nothing to do there."""
        if self.is_local:
            with contextlib.suppress(OSError):
                Path(self.fs_path(rel)).rmdir()

    def upload(self, src: Path, rel: str) -> str:
        """Copy the local file `src` to `rel`; returns its sha256."""
        with self._kinds(rel):
            path = self.fs_path(rel)
            self.backend.make_dirs(path.rsplit("/", 1)[0])
            return self.backend.upload(src, path)

    def download(self, rel: str, dst: Path) -> None:
        """Copy `rel` to the local file `dst` (whole or not at all)."""
        with self._kinds(rel):
            self.backend.download(self.fs_path(rel), dst)

    def copy_to(self, rel: str, dst: Path) -> bool:
        """Make the local file `dst` a copy of `rel` (whole or not at all; nothing
        to do when `dst` is `rel` itself, on a disk); False when `rel` is absent."""
        if self.is_local and Path(self.fs_path(rel)) == Path(dst):
            return self.is_file(rel)
        try:
            self.download(rel, dst)
        except Absent:
            return False
        return True

    def copy_from(self, src: Path, rel: str) -> None:
        """Put the local file `src` at `rel` (nothing to do when it is `rel` itself)."""
        if self.is_local and Path(self.fs_path(rel)) == Path(src):
            return
        self.upload(src, rel)

    def folder_here(self, copies: Path) -> Path:
        """This location as a folder on this machine: itself on a disk; for a
        store, its working copy under `copies` (at the same bucket/prefix path),
        which the caller fills and ships."""
        if self.is_local:
            return self.local_path()
        return copies / self.path.strip("/")

    def file_here(self, rel: str, cache: Path) -> Path:
        """File `rel` as a path on this machine: in place on a disk; from a store,
        downloaded under `cache` (in a folder of this location's own)."""
        if self.is_local:
            return self.local_path(rel)
        import hashlib

        dest = cache / hashlib.sha256(self.uri.encode()).hexdigest()[:16] / rel
        self.download(rel, dest)
        return dest

    # ------------------------------------------------------------------ records

    def append_jsonl(self, rel: str, records: list[dict[str, Any]]) -> None:
        """Append records to a JSON-lines file; appends from several processes (on
        several nodes, for an object store) never overwrite or tear each other."""
        text = "".join(json.dumps(r) + "\n" for r in records)
        with self._kinds(rel):
            self.backend.append(self.fs_path(rel), text)

    def read_jsonl(self, rel: str) -> list[dict[str, Any]]:
        """The records of a JSON-lines file, oldest first; torn or foreign lines
        are skipped."""
        with self._kinds(rel):
            text = self.backend.read_appended(self.fs_path(rel))
        out = []
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
        return out

    # ------------------------------------------------------------------ checks

    def check_writable(self) -> None:
        """Write, read back and delete a small probe file where this location's
        writes would go (a folder not made yet: its nearest existing ancestor; no
        folder is made, the check leaves nothing behind); a UserError naming the
        location and the cause when any step fails (a missing bucket, no
        permission, an unreachable endpoint, a read-only mount)."""
        probe = f".trainlab-probe-{uuid.uuid4().hex}"
        payload = b"trainlab storage probe"
        try:
            here = Location(self.backend, self.backend.nearest_folder(self.path))
            here.write_bytes(probe, payload)
            back = here.read_bytes(probe)
            here.delete(probe)
        except (OSError, ValueError) as e:
            first = redact(first_line(e))
            raise UserError(f"storage {self.describe()} is not writable: {first}") from None
        if back != payload:
            raise UserError(f"storage {self.uri}: a probe file read back differently")

    def unreachable(self, rel: str, error: BaseException) -> UserError:
        """A one-line error for storage that could not be read."""
        hint = f"; check {self.backend.settings_hint}" if self.backend.settings_hint else ""
        return UserError(
            f"{self.uri_of(rel)}{f' ({self.backend.describe()})' if self.backend.describe() else ''}"
            f": cannot read ({redact(first_line(error))}){hint}"
        )
