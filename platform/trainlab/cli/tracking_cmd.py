"""`trainlab tracking up | down | status | import`: a team's MLflow tracking server
(PostgreSQL, sign-in required; trainlab.track.server) and moving an embedded
store's history into it (trainlab.track.history). docs/tracking-teams.md."""

from __future__ import annotations

import click

from trainlab.cli.common import echo_json, json_option
from trainlab.errors import UserError


def _dir_option(fn):  # type: ignore[no-untyped-def]
    return click.option(
        "--dir",
        "dir_",
        type=click.Path(file_okay=False),
        default=None,
        help="Directory of the server's database, logs and credentials "
        "(default: ~/.trainlab/tracking, as root /var/lib/trainlab/tracking; for "
        "down/status: the latest `up`'s).",
    )(fn)


@click.group()
def tracking() -> None:
    """A team's MLflow tracking server: PostgreSQL backend, sign-in required,
    bound to 127.0.0.1 (docs/tracking-teams.md)."""


@tracking.command()
@_dir_option
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Port of the MLflow server (default: the one it had, else 5000, else a free one).",
)
@click.option(
    "--artifacts",
    default=None,
    metavar="PATH_OR_URI",
    help="Artifact store the server writes into: a folder or s3://bucket/prefix "
    "(default: DIR/artifacts).",
)
@click.option(
    "--database-uri",
    default=None,
    metavar="URI",
    help="Use this PostgreSQL database instead of starting one (postgresql://user@host/db; "
    "its password in PGPASSWORD or a PGPASSFILE, never in the URI).",
)
@json_option
def up(
    dir_: str | None, port: int | None, artifacts: str | None, database_uri: str | None,
    as_json: bool,
) -> int:
    """Start PostgreSQL and `mlflow server` with sign-in; print the tracking URI."""
    from trainlab.track.server import ADMIN_USER, server_up

    click.echo("starting PostgreSQL and the MLflow server (sign-in on) ...", err=True)
    state = server_up(dir_, port=port, artifacts=artifacts, database_uri=database_uri)
    info = state.info()
    if as_json:
        echo_json(info)
        return 0
    click.echo(state.uri)
    click.echo(
        f"  sign in as {ADMIN_USER}, password in {info['password_file']} (owner-only)\n"
        f"  runs: export MLFLOW_TRACKING_URI={state.uri} MLFLOW_TRACKING_USERNAME={ADMIN_USER}"
        f" MLFLOW_TRACKING_PASSWORD=\"$(cat {info['password_file']})\"\n"
        f"  database {state.database_uri}; artifacts {state.artifacts}\n"
        f"  stop: trainlab tracking down --dir {state.dir}",
        err=True,
    )
    return 0


@tracking.command()
@_dir_option
@json_option
def down(dir_: str | None, as_json: bool) -> int:
    """Stop the server and its PostgreSQL (the records stay in DIR)."""
    from trainlab.track.server import server_down

    state = server_down(dir_)
    if as_json:
        echo_json({"stopped": state is not None, "uri": state.uri if state else None})
    elif state is None:
        click.echo("no tracking server was started there (`trainlab tracking up` starts one)")
    else:
        click.echo(f"stopped the tracking server at {state.uri}; its records stay in {state.dir}")
    return 0


@tracking.command()
@_dir_option
@json_option
def status(dir_: str | None, as_json: bool) -> int:
    """Show the tracking server started by `trainlab tracking up`, if any."""
    from trainlab.track.server import server_status

    info = server_status(dir_)
    if as_json:
        echo_json(info)
        return 0
    if info is None:
        click.echo("no tracking server was started (`trainlab tracking up` starts one)")
        return 0
    state = "running" if info["answers"] else "not answering"
    parts = [f"mlflow server {'up' if info['mlflow_running'] else 'down'}"]
    if info["database_running"] is not None:
        parts.append(f"PostgreSQL {'up' if info['database_running'] else 'down'}")
    click.echo(f"{info['uri']}: {state} ({', '.join(parts)}); records in {info['dir']}")
    click.echo(f"  sign in as {info['username']}, password in {info['password_file']}")
    return 0


@tracking.command(name="import")
@click.option(
    "--from",
    "source",
    required=True,
    metavar="URI_OR_PATH",
    help="The embedded store to copy: sqlite:///.../mlflow.db, its file, or a runs root.",
)
@click.option(
    "--to",
    "dest",
    default=None,
    metavar="URI",
    help="The tracking server (default MLFLOW_TRACKING_URI; credentials from "
    "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD).",
)
@json_option
def import_(source: str, dest: str | None, as_json: bool) -> int:
    """Copy every run of an embedded store (experiments, params, tags, metrics with
    their steps and times, artifacts) into a tracking server. Runs copied before
    are skipped: running it again copies only what is new."""
    import os

    from trainlab.track.history import copy_history, source_uri
    from trainlab.track.server import check_credentials

    dest = (dest or os.environ.get("MLFLOW_TRACKING_URI", "")).strip()
    if not dest:
        raise UserError("--to: no tracking server given (or set MLFLOW_TRACKING_URI)")
    src = source_uri(source)
    check_credentials(dest)
    result = copy_history(src, dest, progress=lambda line: click.echo(line, err=True))
    if as_json:
        echo_json(result)
    else:
        click.echo(
            f"{result['copied']} run(s) copied, {result['skipped']} already there, "
            f"from {src} into {result['to']}"
        )
    return 0
