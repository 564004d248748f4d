"""From a source's `paths` (files, directories, globs; local or s3:// / gs://)
to the sorted list of files it reads.

Listing happens on the driver before any work, so a path that does not exist
or a glob that matches nothing is a `UserError`, not an empty source. Reading
happens in the workers (`open_bytes`), through trainlab.location for every kind.
Hidden files and folders (a name starting with ".") are skipped when a
directory or glob is expanded, as a shell glob would. A local folder is walked
without leaving it: a symlink below it that leads outside it (`up -> ..`, a link
to /etc/shadow) or loops is skipped with one warning; a path the user names is
read wherever it leads.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from trainlab.errors import UserError
from trainlab.location import Location, locate

log = logging.getLogger("trainlab.data.prep")

GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True, order=True)
class InputFile:
    """One raw file: where it is and what identifies its version (size, mtime)."""

    location: str  # absolute local path, or a URI such as s3://bucket/key
    size: int
    mtime_ns: int


def open_bytes(location: str) -> bytes:
    """The whole content of a file (a local path or a store URI)."""
    return locate(location, what="source file").read_bytes()


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """`*` and `?` stay within one path segment, `**` spans any number of them."""
    parts = pattern.split("/")
    out = []
    for i, seg in enumerate(parts):
        last = i == len(parts) - 1
        if seg == "**":
            out.append(".*" if last else "(?:[^/]+/)*")
            continue
        out.append(_segment_regex(seg) + ("" if last else "/"))
    return re.compile("".join(out) + r"\Z")


def _segment_regex(seg: str) -> str:
    out, i = [], 0
    while i < len(seg):
        c = seg[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := _class_end(seg, i)) > 0:
            body = seg[i + 1 : end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _class_end(seg: str, start: int) -> int:
    """Index of the `]` closing the class opened at `start`, or -1 (then `[` is literal)."""
    j = start + 1
    if seg[j : j + 1] == "!":
        j += 1
    if seg[j : j + 1] == "]":
        j += 1
    return seg.find("]", j)


def _glob_base(pattern: str) -> str:
    """The longest leading part of `pattern` without glob characters (a directory)."""
    parts = pattern.split("/")
    base = []
    for seg in parts:
        if GLOB_CHARS.search(seg):
            break
        base.append(seg)
    return "/".join(base) or "/"


def list_files(entry: str, root: Path, source_name: str) -> list[InputFile]:
    """The files one `paths` entry names, sorted; UserError when there are none."""
    where = f"source {source_name!r}: {entry!r}"
    place = locate(entry, what=where, base_dir=root).resolved()
    target = place.path
    if entry.endswith("/") and not target.endswith("/"):
        target += "/"
    try:
        if GLOB_CHARS.search(target):
            found = _expand_glob(place, target, where)
            if not found:
                raise UserError(f"{where}: glob matches no files")
        else:
            found = _expand_plain(place, target.rstrip("/") or "/", where)
    except OSError as e:
        raise UserError(f"{where}: cannot list ({e})") from None
    return sorted(
        InputFile(place.backend.uri(info.path), info.size or 0, info.mtime_ns or 0)
        for info in found
    )


def _expand_plain(place: Location, target: str, where: str) -> list:
    from pyarrow import fs

    info = place.filesystem.get_file_info(target)
    if info.type == fs.FileType.NotFound:
        raise UserError(f"{where}: path does not exist ({target})")
    if info.type == fs.FileType.File:
        return [info]
    found = _files_below(place, target, where)
    if not found:
        raise UserError(f"{where}: directory holds no files ({target})")
    return found


def _expand_glob(place: Location, pattern: str, where: str) -> list:
    from pyarrow import fs

    base = _glob_base(pattern)
    if place.filesystem.get_file_info(base).type != fs.FileType.Directory:
        return []
    regex = glob_to_regex(pattern)
    return [i for i in _files_below(place, base, where) if regex.match(i.path)]


def _files_below(place: Location, base: str, where: str) -> list:
    """Every file below the directory `base` of `place`'s storage, hidden names
    skipped; a local folder is walked without leaving it (`Location.files_below`)."""
    found, skipped = Location(place.backend, base).files_below()
    if skipped:
        log.warning(
            "%s: skipped %d symlink%s leading outside %s or into a loop (first: %s)",
            where,
            len(skipped),
            "" if len(skipped) == 1 else "s",
            base,
            skipped[0],
        )
    return found


def list_source_files(entries: list[str], root: Path, source_name: str) -> list[InputFile]:
    """Every file of one source, each once, sorted by location (the dedup order)."""
    files: dict[str, InputFile] = {}
    for entry in entries:
        for f in list_files(entry, root, source_name):
            files.setdefault(f.location, f)
    return sorted(files.values())
