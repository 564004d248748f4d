"""User-facing errors.

A `UserError` is a problem with what the user gave us (config, data, files,
flags). The CLI prints it as one line per problem, without a traceback, and
exits with code 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


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
