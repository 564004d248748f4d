"""User-facing errors.

A `UserError` is a problem with what the user gave us (config, data, files,
flags). The CLI prints it as one line per problem, without a traceback, and
exits with code 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

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


def read_yaml(path: Path, error: type[UserError] = UserError) -> Any:
    """The parsed YAML of `path` (None for an empty file), within the bounds of
    `trainlab.boundedyaml`. A file that cannot be read or parsed, or that exceeds a
    bound, raises `error` naming it, with line:column for a syntax error."""
    import yaml

    from trainlab import boundedyaml

    try:
        # Before reading: a huge file is refused without holding it in memory.
        size = path.stat().st_size
        if size > boundedyaml.MAX_BYTES:
            limit = boundedyaml.MAX_BYTES
            raise error(f"{path}: {size} bytes, more than the limit of {limit} for a YAML file")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return boundedyaml.load(text)
    except boundedyaml.YamlLimitError as e:
        raise error(f"{path}: refused: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{where}: invalid YAML ({clip(problem)})") from None


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
