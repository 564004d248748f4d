"""User-facing errors.

A `UserError` is a problem with what the user gave us (config, data, files,
flags). The CLI prints it as one line per problem, without a traceback, and
exits with code 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError


def first_line(e: BaseException) -> str:
    """An exception's first line of text, or its type's name when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class UserError(Exception):
    """Bad input from the user; exit code 2, no traceback."""

    exit_code = 2

    def __init__(self, message: str | list[str]):
        self.lines = [message] if isinstance(message, str) else list(message)
        super().__init__("\n".join(self.lines))


class ConfigError(UserError):
    """One or more problems in an experiment config; one line per problem."""


def quote(value: Any, limit: int = 200) -> str:
    """`repr(value)` for an error line, cut to its first `limit` characters when
    longer: a line quotes what the user gave, never megabytes of it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def clip(text: str, limit: int = 300) -> str:
    """`text` cut to its first `limit` characters when longer (a message that may
    embed a user's value, e.g. a validator's)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


# --------------------------------------------------------------------------- user files
# Shared by every reader of a user's YAML file (experiment configs, sources files),
# so they word the same problem the same way.


# What a path names when it is not a regular file, in the words of an error line.
_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_regular(mode: int) -> str | None:
    """What a file of `mode` is when it is not a regular file, else None."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _NOT_REGULAR if test(mode)), "not a plain file")


def read_user_file(path: Path, error: type[UserError] = UserError) -> str:
    """The text of a user's YAML file, read only if it is a regular file (after
    symlinks) and at most `boundedyaml.MAX_BYTES` of it. A directory, FIFO, device or
    socket is refused by its kind before it is opened for reading (a FIFO can
    never block, /dev/zero never fills memory); a symlink loop, a file too big or
    not UTF-8 is one line naming the file, never quoting it."""
    from trainlab import boundedyaml

    limit = boundedyaml.MAX_BYTES
    too_big = f"more than the limit of {limit} for a YAML file"
    try:
        info = os.stat(path)  # follows symlinks; ELOOP for a loop
        kind = _not_regular(info.st_mode)
        if kind is None and info.st_size > limit:
            # Before reading: a huge file is refused without holding it in memory.
            raise error(f"{path}: {info.st_size} bytes, {too_big}")
        if kind is None:
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
            with os.fdopen(os.open(path, flags), "rb") as f:
                # What was opened, should the path have changed since the stat.
                kind = _not_regular(os.fstat(f.fileno()).st_mode)
                data = b"" if kind else f.read(limit + 1)
        if kind is not None:
            raise error(f"{path}: not a regular file ({kind}); expected a YAML file")
        if len(data) > limit:  # grew since the stat, or a file whose size says 0 (/proc)
            raise error(f"{path}: {too_big} (read {limit + 1} bytes and stopped)")
        return data.decode("utf-8")
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise error(f"{path}: symlink loop") from None
        raise error(f"{path}: cannot read ({e.strerror or e})") from None


# Quoted text in a YAML parser's message: an alias's or a tag's name is the file's
# content and is left out; one character (the repr of '\t', '\x00') and a token
# of the grammar ('<block end>') are kept.
_QUOTED = re.compile(r"'([^']*)'|\"([^\"]*)\"")
_KEPT = re.compile(r".|<[a-z ]+>|\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|[0abfnrtv\\])", re.S)


def _without_quotes(problem: str) -> str:
    def keep(m: re.Match[str]) -> str:
        inner = m.group(1) if m.group(1) is not None else m.group(2)
        return m.group(0) if _KEPT.fullmatch(inner) else "'...'"

    return _QUOTED.sub(keep, problem)


def read_yaml(path: Path, error: type[UserError] = UserError, what: str = "") -> Any:
    """The parsed YAML of `path` (None for an empty file), read by `read_user_file`
    and parsed within the bounds of `trainlab.boundedyaml`. A file that cannot be
    read or parsed, or that exceeds a bound, raises `error` naming it, with
    line:column for a syntax error (and, given `what`, saying it is not `what`:
    "not a trainlab config (invalid YAML: ...)"); the parser's message is quoted
    without the file's text."""
    import yaml

    from trainlab import boundedyaml

    text = read_user_file(path, error)
    try:
        return boundedyaml.load(text)
    except boundedyaml.YamlLimitError as e:
        raise error(f"{path}: refused: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        problem = clip(_without_quotes(problem))
        if what:
            raise error(f"{where}: not {what} (invalid YAML: {problem})") from None
        raise error(f"{where}: invalid YAML ({problem})") from None


@dataclass(frozen=True)
class FieldError:
    """One problem pydantic found, in the words a user reads."""

    loc: tuple[Any, ...]
    where: str  # dotted path of the field; "(top level)" for the whole document
    value: Any  # what the user gave
    kind: str  # pydantic's error type: "missing", "extra_forbidden", "value_error", ...
    message: str  # pydantic's message without its "Value error, " prefix

    @property
    def rule(self) -> str:
        """The message as a rule, to follow "where = value: " (first letter lowercase)."""
        return self.message[:1].lower() + self.message[1:]


def field_errors(err: ValidationError, prefix: tuple[Any, ...] = ()) -> list[FieldError]:
    """Every problem of a pydantic `ValidationError`, located under `prefix`."""
    out = []
    for e in err.errors():
        loc = (*prefix, *e["loc"])
        out.append(
            FieldError(
                loc=loc,
                where=".".join(str(p) for p in loc) or "(top level)",
                value=e.get("input"),
                kind=e["type"],
                message=e["msg"].removeprefix("Value error, "),
            )
        )
    return out
