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


# --------------------------------------------------------------------------- user files
# Shared by every reader of a user's YAML file (experiment configs, sources files),
# so they word the same problem the same way.


def read_yaml(path: Path, error: type[UserError] = UserError) -> Any:
    """The parsed YAML of `path` (None for an empty file). A file that cannot be read
    or parsed raises `error` naming it, with line:column for a syntax error."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
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
