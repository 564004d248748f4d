"""Options shared by commands, so every command spells them the same way."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

F = Callable[..., Any]


def config_args(fn: F) -> F:
    """CONFIG argument plus repeatable `--set KEY=VALUE` (value parsed as YAML)."""
    fn = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                      help="Override a config value, e.g. --set train.lr=1e-4 (repeatable).")(fn)
    return click.argument("config", type=click.Path(dir_okay=False))(fn)


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True,
                        help="Print machine-readable JSON on stdout.")(fn)


def echo_json(obj: Any) -> None:
    """One JSON document on stdout (the last line is the object)."""
    click.echo(json.dumps(obj, indent=None, sort_keys=False, default=str))
