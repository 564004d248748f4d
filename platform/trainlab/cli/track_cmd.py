"""`trainlab compare | runs | ui | track-flush`: reading the experiment records back,
and writing those that waited for a busy store (trainlab.track.journal).

All three read the store `trainlab.track.tracking_uri(--runs-root)`: the
embedded SQLite store in the runs root, or MLFLOW_TRACKING_URI when set.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from trainlab.cli.common import (
    default_runs_root,
    echo_json,
    json_option,
    runs_root_hint,
    runs_root_option,
    wide_console,
)
from trainlab.errors import UserError

F = Callable[..., Any]


def _runs_root_option(fn: F) -> F:
    return runs_root_option(
        "Runs root whose store to read (ignored when MLFLOW_TRACKING_URI is set)."
    )(fn)


def _experiment_option(fn: F) -> F:
    return click.option(
        "--experiment", "-e", default=None, metavar="E", help="Only runs of this MLflow experiment."
    )(fn)


def _since_option(fn: F) -> F:
    return click.option(
        "--since",
        default=None,
        metavar="DATE",
        help="Only runs started on or after DATE (2026-05-01 or 2026-05-01T14:30, local time).",
    )(fn)


# --------------------------------------------------------------------------- compare


@click.command()
@click.argument("names", nargs=-1, metavar="[NAME ...]")
@_experiment_option
@_since_option
@json_option
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV on stdout.")
@_runs_root_option
def compare(
    names: tuple[str, ...],
    experiment: str | None,
    since: str | None,
    as_json: bool,
    as_csv: bool,
    runs_root: str | None,
) -> int:
    """Compare runs side by side: one row per run (newest first), the config keys
    that differ between them highlighted. NAME is a run name or run id; none
    means every run (within --experiment / --since)."""
    from trainlab.track import tracking_uri
    from trainlab.track.query import compare_report, parse_since

    if as_json and as_csv:
        raise UserError("--json and --csv: choose one output format")
    uri = tracking_uri(default_runs_root(runs_root))
    report = compare_report(uri, names, experiment, parse_since(since))
    rows = report["runs"]
    if as_json:
        echo_json(report)
    elif as_csv:
        _write_csv(rows)
    elif not rows:
        click.echo(f"no runs recorded in {uri}{runs_root_hint(runs_root)}")
    else:
        _print_compare(rows, uri)
        _print_noise(report)
    return 0


def _print_noise(report: dict[str, Any]) -> None:
    """Groups as mean ± sd (n) per metric; each other run or group against the
    oldest (the reference): the difference, its 95% interval, the verdict
    (docs/noise.md)."""
    from trainlab.track.noise import METRICS

    console = _console()
    for g in report["groups"]:
        bands = "; ".join(
            f"{m} {b['mean']:.4f} ± {b['std']:.4f} (n={b['n']})"
            if b["std"] is not None
            else f"{m} {_num(b['mean'], '.4f')} (n={b['n']}, no sd)"
            for m, b in g["metrics"].items()
        )
        console.print(
            f"group {g['group_id']} ({g['name']}, {g['n']} seeds): {bands}", highlight=False
        )
    for c in report["comparisons"]:
        if "noise_from" in c:
            source = (
                f"noise band of recorded group {c['noise_from']}"
                if c["noise_from"]
                else "no recorded group of this experiment: noise unknown (--repeats K measures it)"
            )
        else:
            source = "Welch t" if "group" in c["a"] and "group" in c["b"] else "group's band"
        console.print(f"{c['b']} vs {c['a']} ({source}):", highlight=False)
        for m in METRICS:
            r = c["metrics"][m]
            if r["difference"] is None or r["difference"] != r["difference"]:
                continue  # the metric is missing on a side
            interval = (
                f"95% interval [{r['interval'][0]:+.4f}, {r['interval'][1]:+.4f}]"
                if r["interval"]
                else "no interval"
            )
            console.print(
                f"  {m}: {r['difference']:+.4f}, {interval}: {r['verdict']}", highlight=False
            )
    env_keys = list(report["runs"][0].get("environment_differing") or {})
    if len(report["runs"]) > 1:
        note = ", ".join(
            f"{k} ({' / '.join(sorted({str(r['environment'].get(k)) for r in report['runs']}))})"
            for k in env_keys
        )
        console.print(f"differing environment: {note or 'none'}", highlight=False)


CSV_HEAD = (
    "name",
    "run_id",
    "experiment",
    "status",
    "started",
    "final_step",
    "total_steps",
    "tokens_trained",
    "extended",
    "final_loss",
    "val_loss",
    "best_val_loss",
    "tokens_per_second",
    "peak_memory_gb",
    "wall_time_s",
    "config_hash",
    "dataset_fingerprint",
    "git_commit",
)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)


def _write_csv(rows: list[dict[str, Any]]) -> None:
    """Headline columns, then mix.<source>, then every flattened param as param.<key>."""
    sources = sorted({s for r in rows for s in r["mix"]})
    keys = sorted({k for r in rows for k in r["params"]})
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow([*CSV_HEAD, *(f"mix.{s}" for s in sources), *(f"param.{k}" for k in keys)])
    for r in rows:
        writer.writerow(
            [
                *(_cell(r[c]) for c in CSV_HEAD),
                *(_cell(r["mix"].get(s)) for s in sources),
                *(_cell(r["params"].get(k)) for k in keys),
            ]
        )


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _steps_cell(row: dict[str, Any]) -> str:
    """Steps trained / the run's length, and whether it was extended (--extend)."""
    done, total = row.get("final_step"), row.get("total_steps")
    text = f"{_num(done, 'd')}/{_num(total, 'd')}"
    return f"{text} (extended)" if row.get("extended") else text


def _count(n: int | None) -> str:
    """1234 -> 1.2k, 15_360_000 -> 15.4M."""
    if n is None:
        return "-"
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _mix(mix: dict[str, Any]) -> str:
    return (
        " ".join(
            f"{k}={v:g}" if isinstance(v, int | float) else f"{k}={v}"
            for k, v in sorted(mix.items())
        )
        or "(manifest)"
    )


def _status_cell(row: dict[str, Any]) -> str:
    """A run's status, and how many of its records still wait for the store."""
    pending = row.get("records_pending")
    return f"{row['status']} ({pending} records pending)" if pending else str(row["status"])


def _print_compare(rows: list[dict[str, Any]], uri: str) -> None:
    from rich.table import Table

    differing = list(rows[0]["differing"])
    table = Table(title=f"{len(rows)} run(s) in {uri}", title_justify="left")
    cells = [
        [
            r["name"],
            r["run_id"][:8],
            _status_cell(r),
            _steps_cell(r),
            _count(r["tokens_trained"]),
            _num(r["final_loss"], ".4f"),
            _num(r["val_loss"], ".4f"),
            _num(r["best_val_loss"], ".4f"),
            _num(r["tokens_per_second"], ",.0f"),
            _num(r["peak_memory_gb"], ".2f"),
            _num(r["wall_time_s"], ".0f"),
            _mix(r["mix"]),
        ]
        for r in rows
    ]
    for i, (column, justify) in enumerate(
        (
            ("name", "left"),
            ("run", "left"),
            ("status", "left"),
            ("steps", "right"),
            ("tokens", "right"),
            ("final loss", "right"),
            ("val loss", "right"),
            ("best val loss", "right"),
            ("tok/s", "right"),
            ("peak GB", "right"),
            ("wall s", "right"),
            ("mix", "left"),
        )
    ):
        # Numbers are never cut on a narrow terminal (the text columns wrap instead).
        width = max(len(c[i]) for c in cells) if justify == "right" else None
        table.add_column(column, justify=justify, min_width=width)  # type: ignore[arg-type]
    for row in cells:
        table.add_row(*row)
    console = _console()
    console.print(table)
    console.print(
        "steps: trained / the run's length (an extended run's as extended); tokens: "
        "tokens trained; val loss: the latest held-out evaluation; best val loss: the "
        "lowest of the run's evaluations",
        highlight=False,
    )
    if len(rows) > 1 and differing:  # the keys, once: the table names each with its values
        console.print(_differing_table(rows, differing))
    elif len(rows) > 1:
        console.print("differing config keys: none (same config)", highlight=False)


def _differing_table(rows: list[dict[str, Any]], differing: list[str]) -> Any:
    """The differing config keys, one per row (full names, never cut), one column
    per run: readable with many keys, where a column per key would squeeze its
    header to `train.…`."""
    from rich.table import Table

    table = Table(title="differing config keys", title_justify="left")
    table.add_column("key", style="bold yellow", no_wrap=True)
    for r in rows:
        table.add_column(f"{r['name']}\n{r['run_id'][:8]}", overflow="fold")
    for key in differing:
        table.add_row(key, *(_cell(r["differing"][key]) for r in rows))
    return table


# --------------------------------------------------------------------------- runs


@click.command()
@_experiment_option
@_since_option
@click.option(
    "--limit",
    "-n",
    default=20,
    show_default=True,
    type=click.IntRange(min=1),
    help="Show at most this many runs.",
)
@json_option
@_runs_root_option
def runs(
    experiment: str | None, since: str | None, limit: int, as_json: bool, runs_root: str | None
) -> int:
    """List recent runs, newest first: name, status, started, active training
    time and wall time (a resumed run's wall time includes the idle time between
    its starts). A run whose processes vanished shows as `lost`."""
    from trainlab.track import tracking_uri
    from trainlab.track.query import list_runs, parse_since

    uri = tracking_uri(default_runs_root(runs_root))
    rows = list_runs(uri, experiment, parse_since(since), limit)
    if as_json:
        echo_json(rows)
        return 0
    if not rows:
        click.echo(f"no runs recorded in {uri}{runs_root_hint(runs_root)}")
        return 0
    from rich.table import Table

    table = Table(title=f"recent runs in {uri}", title_justify="left")
    for column in ("name", "run_id", "experiment", "status", "started", "active", "wall"):
        table.add_column(column, justify="right" if column in ("active", "wall") else "left")
    for r in rows:
        table.add_row(
            r["name"],
            r["run_id"],
            r["experiment"],
            _status_cell(r),
            r["started"] or "-",
            _duration(r["active_s"]) if r.get("active_s") is not None else "-",
            _duration(r["duration_s"]),
        )
    _console().print(table)
    return 0


def _console() -> Any:
    """Rich console; wide when piped, so tables are not squeezed into 80 columns."""
    return wide_console()


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


# --------------------------------------------------------------------------- track-flush


@click.command("track-flush")
@click.argument("run_dir", metavar="RUN_DIR_OR_URI")
@click.option(
    "--runs-root",
    default=None,
    type=click.Path(file_okay=False),
    help="Runs root whose store the run belongs to (default: RUN_DIR's grandparent).",
)
def track_flush(run_dir: str, runs_root: str | None) -> int:
    """Write the records of RUN_DIR that wait in its journal
    (logs/mlflow-journal.jsonl) because the MLflow store did not answer. Exit 0
    when all are in the store, 1 when some still wait (the store is still busy)."""

    from trainlab.run.location import RunLocation
    from trainlab.track.backend import client_for, tracking_uri
    from trainlab.track.journal import (
        JOURNAL,
        MARKER,
        Journal,
        clear_pending_in_summary,
        flush_journal,
        store_busy,
    )

    loc = RunLocation.of(run_dir)
    if not loc.home.exists():
        raise UserError(f"RUN_DIR {run_dir}: no such run (a run directory or s3:// URI)")
    for name in (JOURNAL, MARKER):  # a run in object storage: its shipped journal, here
        loc.fetch(f"logs/{name}")
    runs_root = runs_root or loc.home.resolved().parent.parent.uri  # the store of its runs root
    journal = Journal(loc.local)
    before = journal.pending_count()
    if not before:
        click.echo(f"{run_dir}: no records wait; the store has them all")
        return 0
    uri = tracking_uri(runs_root)
    if store_busy(uri):
        click.echo(f"{run_dir}: {before} record(s) wait; the store is locked by another process")
        return 1
    left = flush_journal(journal, client_for(uri, flush_records=False))
    if (loc.local / "logs" / MARKER).exists():  # what is written, shipped back
        loc.ship(f"logs/{MARKER}")
    if left:
        click.echo(f"{run_dir}: {before - left} record(s) written, {left} still wait")
        return 1
    clear_pending_in_summary(run_dir)
    click.echo(f"{run_dir}: {before} record(s) written; the store has them all")
    return 0


# --------------------------------------------------------------------------- ui


@click.command()
@click.option("--port", default=5000, show_default=True, type=click.IntRange(1, 65535))
@_runs_root_option
def ui(port: int, runs_root: str | None) -> int:
    """Start the MLflow UI on 127.0.0.1 against the runs store (Ctrl-C stops it)."""
    from trainlab.track import mlflow_ui
    from trainlab.track.backend import ENV_TRACKING_URI, artifact_location, tracking_uri

    runs_root = default_runs_root(runs_root)
    uri = tracking_uri(runs_root)
    if uri.startswith(("http://", "https://")):
        click.echo(
            f"{ENV_TRACKING_URI} points at a tracking server: open {uri} in a browser "
            "(choose 'Model training' at the top left: experiments then open on their runs)"
        )
        return 0
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--uvicorn-opts",
        "--log-level warning",  # not a line per start-up phase and request
    ]
    root = artifact_location(runs_root)
    if root:
        command += ["--default-artifact-root", root]
    if mlflow_ui.installed():  # experiments open on their runs table (trainlab.track.mlflow_ui)
        command += ["--app-name", mlflow_ui.APP_NAME]
    else:
        click.echo(
            "note: this install predates trainlab's MLflow app; experiments may open on the "
            "GenAI overview (choose 'Model training' at the top left, or reinstall: "
            ".venv/bin/pip install --no-deps -e .)",
            err=True,
        )
    click.echo(f"MLflow UI for {uri} at http://127.0.0.1:{port} (Ctrl-C stops it)", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # The server's own noise: MLflow's INFO lines and starlette's deprecation of the
    # WSGI middleware MLflow imports (a warning for MLflow's developers, not ours).
    env = {**os.environ, "MLFLOW_LOGGING_LEVEL": os.environ.get("MLFLOW_LOGGING_LEVEL", "WARNING")}
    quiet = "ignore:starlette.middleware.wsgi is deprecated:UserWarning"
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), quiet) if w)
    # Become the server: Ctrl-C and signals then reach it (and its workers) directly.
    os.execve(sys.executable, command, env)
    return 0  # not reached
