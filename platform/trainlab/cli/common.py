"""Options shared by commands, so every command spells them the same way."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import click

F = Callable[..., Any]

# With --json: the process's real stdout, which only the JSON document goes to.
_json_out: TextIO | None = None


def config_args(fn: F) -> F:
    """CONFIG argument plus repeatable `--set KEY=VALUE` (value parsed as YAML)."""
    fn = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                      help="Override a config value, e.g. --set train.lr=1e-4 (repeatable).")(fn)
    return click.argument("config", type=click.Path(dir_okay=False))(fn)


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True,
                        help="Print machine-readable JSON on stdout.")(fn)


@contextlib.contextmanager
def stdout_for_json_only() -> Iterator[None]:
    """With --json, stdout carries nothing but the JSON: inside this block
    whatever else writes to file descriptor 1 (Ray's and Tune's banners, worker
    output Ray forwards to the driver, MLflow, child processes) goes to stderr,
    and `echo_json` writes to the real stdout. Used by `trainlab.cli.main` for a
    command line with --json; a no-op where sys.stdout is not the process's own
    (a test runner capturing it)."""
    global _json_out
    if _json_out is not None or sys.stdout is not sys.__stdout__:
        yield
        return
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    _json_out = os.fdopen(real, "w")
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(real, 1)
        _json_out.close()
        _json_out = None


def echo_json(obj: Any) -> None:
    """One JSON document on stdout (the last line is the object)."""
    text = json.dumps(obj, indent=None, sort_keys=False, default=str)
    if _json_out is None:
        click.echo(text)
        return
    _json_out.write(text + "\n")
    _json_out.flush()


# --------------------------------------------------------------------------- --runs-root

DEFAULT_RUNS_ROOT = "runs"


def runs_root_option(help_text: str) -> Callable[[F], F]:
    """`--runs-root DIR`; left out: the project's `runs/` (`default_runs_root`), the
    same folder wherever in the project the command runs (notebooks/ included)."""

    def decorate(fn: F) -> F:
        return click.option(
            "--runs-root",
            default=None,
            type=click.Path(file_okay=False),
            help=f"{help_text} Default: runs/ of the project (the nearest folder at or "
            "above the current one holding .git or pyproject.toml).",
        )(fn)

    return decorate


def default_runs_root(given: str | None) -> str:
    """`--runs-root` as given (a path the user typed is the shell's: relative to the
    current directory), else `{project root}/runs`, else `./runs` outside a project."""
    if given is not None:
        return given
    from trainlab.config.loader import project_root

    return str((project_root() or Path.cwd()) / DEFAULT_RUNS_ROOT)


def runs_root_hint(given: str | None) -> str:
    """What to add to "no runs recorded in ...": nothing, or, outside any project
    with no --runs-root, where the command looked and how to point it elsewhere."""
    from trainlab.config.loader import project_root

    if given is not None or project_root() is not None:
        return ""
    return (
        f" (no project at or above {Path.cwd()}: run from inside the project, or give "
        "--runs-root DIR, the train.runs_root of your runs)"
    )


def wide_console(stderr: bool = False) -> Any:
    """A rich Console; wide when piped (a file, `| less`, CI), so tables and long
    lines are not wrapped at the 80 columns rich assumes without a terminal."""
    from rich.console import Console

    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=max(console.width, 200))
