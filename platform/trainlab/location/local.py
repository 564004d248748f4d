"""This machine's disk (a local folder or a shared mount such as NFS) as a backend.

Its operations go through `os` directly: no pyarrow import for a config's
validation, O_APPEND for appends, a temporary file and a rename for an atomic
replace. pyarrow's LocalFileSystem is there for the readers that take a
filesystem (Parquet, Ray Train).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import uuid
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainlab.location.core import Backend
from trainlab.location.lease import DiskLease, disk_kept_still


class LocalDisk(Backend):
    scheme = ""
    local = True
    poll_interval_s = 0.0  # a local read is cheap: look at every poll

    def make_filesystem(self) -> Any:
        from pyarrow import fs

        return fs.LocalFileSystem()

    def uri(self, path: str) -> str:
        return path

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write_atomic(self, path: str, data: bytes) -> None:
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            tmp.write_bytes(data)
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)

    def append(self, path: str, text: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:  # O_APPEND: whole lines from several processes
            f.write(text)

    def read_appended(self, path: str) -> str:
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return ""

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def make_dirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def list(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def walk(self, path: str) -> list[tuple[str, int]]:
        root = Path(path)
        if not root.is_dir():
            return []
        return sorted(
            (p.relative_to(root).as_posix(), p.stat().st_size)
            for p in root.rglob("*")
            if p.is_file() and not p.is_symlink()
        )

    def files(self, path: str) -> list[tuple[str, int, float]]:
        out = []
        for d, _, names in os.walk(path):  # symlinked folders are not walked into
            for name in names:
                p = os.path.join(d, name)
                st = os.lstat(p)
                if not stat.S_ISLNK(st.st_mode):
                    out.append(
                        (os.path.relpath(p, path).replace(os.sep, "/"), st.st_size, st.st_mtime)
                    )
        return sorted(out)

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def files_below(self, path: str) -> tuple[list[Any], list[str]]:
        return _walk_inside(path)

    def file_size(self, path: str) -> int | None:
        return os.path.getsize(path) if os.path.isfile(path) else None

    def modified(self, path: str) -> float | None:
        try:
            return os.stat(path).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            return None

    def delete_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def delete_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def nearest_folder(self, path: str) -> str:
        here = Path(path)
        for d in (here, *here.parents):
            if d.is_dir():
                return str(d)
            if d.exists() or d.is_symlink():  # a file (or a dangling link) on the way
                raise NotADirectoryError(f"{d}: not a directory")
        return "/"

    def lease(self, place: Any, on_lost: Any) -> Any:
        """A disk's lease: an OS file lock and its record (nothing is ever lost)."""
        return DiskLease.take(Path(place.path))

    def kept_still(self, place: Any) -> AbstractContextManager[str | None]:
        return disk_kept_still(Path(place.path))

    def free_bytes(self, path: str) -> float:
        # a run directory not made yet: the disk of its nearest existing folder
        return float(shutil.disk_usage(self.nearest_folder(path)).free)

    def reserve(self, path: str, size: int) -> bool:
        target = Path(path)
        try:
            if target.exists() and target.stat().st_size >= size:
                return True
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                try:
                    os.posix_fallocate(f.fileno(), 0, size)
                except (AttributeError, OSError):  # no fallocate here: write it
                    f.write(b"\0" * size)
                    f.flush()
                    os.fsync(f.fileno())
            return True
        except OSError:
            target.unlink(missing_ok=True)
            return False

    def release(self, path: str) -> None:
        Path(path).unlink(missing_ok=True)

    def upload(self, src: Path, path: str) -> str:
        h = hashlib.sha256()
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(src, "rb") as f, open(tmp, "wb") as out:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
                    out.write(chunk)
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)
        return h.hexdigest()

    def download(self, path: str, dst: Path) -> None:
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.part-{uuid.uuid4().hex[:8]}")
        try:
            shutil.copyfile(path, tmp)
            tmp.replace(dst)
        finally:
            tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class _LocalFile:
    path: str
    size: int
    mtime_ns: int


def _walk_inside(base: str) -> tuple[list[_LocalFile], list[str]]:
    """The regular files below the local folder `base` (hidden names skipped), and
    the symlinks not followed, sorted: those leading outside `base` (`shadow.txt ->
    /etc/shadow`, `up -> ..`) and those that loop. A symlink to a folder inside
    `base` is not entered either: the walk reaches that folder by its own path."""
    root = Path(base).resolve()
    found: list[_LocalFile] = []
    skipped: list[str] = []

    def leaves(path: str) -> bool | None:
        """Whether the symlink `path` leads outside `root` or loops; None: dangling."""
        try:
            return not Path(path).resolve(strict=True).is_relative_to(root)
        except FileNotFoundError:
            return None
        except (OSError, RuntimeError):  # a loop (RuntimeError before Python 3.13)
            return True

    for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in dirnames:  # a symlink to a folder is listed here, never entered
            path = os.path.join(dirpath, name)
            if os.path.islink(path) and leaves(path):
                skipped.append(path)
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name.startswith("."):
                continue
            away = leaves(path) if os.path.islink(path) else False
            if away:
                skipped.append(path)
            if away is not False:
                continue  # outside, a loop, or dangling (no file, as before)
            try:
                st = os.stat(path)
            except OSError:
                continue  # gone since it was listed
            if stat.S_ISREG(st.st_mode):
                found.append(_LocalFile(path, st.st_size, st.st_mtime_ns))
    return found, sorted(skipped)


LOCAL = LocalDisk()
