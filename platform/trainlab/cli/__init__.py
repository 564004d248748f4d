"""The `trainlab` command line.

Commands are registered by import path and imported only when run, so
`trainlab validate` never pays for Ray or torch. Each command module owns its
commands; add one by adding a line to `COMMANDS`.

Errors: a `UserError` (bad config, data, file or flag) prints one line per
problem as `error: ...` and exits 2, without a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys

import click

from trainlab.errors import UserError
from trainlab.exitcodes import INTERRUPTED, TERMINATED

RAY_TOKEN_NOTICE = "ray._private.authentication.authentication_token_setup"

# command name -> "module:attribute" of a click command
COMMANDS: dict[str, str] = {
    "validate": "trainlab.cli.config_cmds:validate",
    "show": "trainlab.cli.config_cmds:show",
    "plan": "trainlab.cli.config_cmds:plan_cmd",
    "prep": "trainlab.cli.prep_cmd:prep",
    "data": "trainlab.cli.data_cmd:data",
    "train": "trainlab.cli.train_cmd:train",
    "compare": "trainlab.cli.track_cmd:compare",
    "runs": "trainlab.cli.track_cmd:runs",
    "ui": "trainlab.cli.track_cmd:ui",
    "track-flush": "trainlab.cli.track_cmd:track_flush",
    "tracking": "trainlab.cli.tracking_cmd:tracking",
    "submit": "trainlab.cli.jobs_cmd:submit",
    "jobs": "trainlab.cli.jobs_cmd:jobs",
    "stop": "trainlab.cli.jobs_cmd:stop",
    "cluster": "trainlab.cli.jobs_cmd:cluster",
    "tune": "trainlab.cli.tune_cmd:tune",
    "gc": "trainlab.cli.gc_cmd:gc",
    "export": "trainlab.cli.export_cmd:export",
    "mix": "trainlab.cli.mix_cmd:mix",
}

HELP = {
    "validate": "Check a config; print ok and its name, or every problem.",
    "show": "Print the fully resolved config as YAML.",
    "plan": "Parameters, memory per device, parallel layout, FLOPs per token.",
    "prep": "Tokenize raw sources once into Parquet shards + manifest (Ray Data).",
    "data": "Inspect the mixed, packed training stream.",
    "train": "Train a config on Ray Train (RAY_ADDRESS, the `cluster up` one, or embedded).",
    "compare": "Compare runs from MLflow side by side.",
    "runs": "List recent runs.",
    "ui": "Start the MLflow UI on 127.0.0.1 against the runs store.",
    "track-flush": "Write a run's records that waited for a busy MLflow store.",
    "tracking": "A team's MLflow tracking server (PostgreSQL, sign-in): up, down, status, import.",
    "submit": "Validate, plan and submit a config as a Ray job.",
    "jobs": "List Ray jobs with their status.",
    "stop": "Stop a Ray job.",
    "cluster": "Start or stop a local Ray head node.",
    "tune": "Ray Tune search over data-mix weights.",
    "gc": "Delete old runs and smoke rehearsals (keeps last valid + best checkpoint).",
    "export": "Write a checkpoint as a Hugging Face model directory (transformers).",
    "mix": "Mixture laws: proxy swarm (Ray Tune), fit, propose, confirm.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, HELP.get(name, "")) for name in COMMANDS])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trainlab")
def cli() -> None:
    """trainlab: validated experiment configs in; prepared data, fault-tolerant
    Ray Train runs and comparable MLflow records out."""


def main(argv: list[str] | None = None) -> None:
    from trainlab.cli.common import stdout_for_json_only

    # Ray's notice that token authentication is on (the secure default every
    # trainlab cluster uses) is printed by every Ray-backed command: not news.
    logging.getLogger(RAY_TOKEN_NOTICE).setLevel(logging.ERROR)
    # MLflow's INFO lines (system-metrics start and stop, "Creating initial MLflow
    # database tables", ...) are not the command's output (`export`, `compare`, ...);
    # read when MLflow is imported, so set before any command imports it.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    args = sys.argv[1:] if argv is None else argv
    from trainlab.cli.localray import use_local_cluster

    use_local_cluster(args)  # the running cluster of `trainlab cluster up`, if any
    json_only = stdout_for_json_only() if "--json" in args else contextlib.nullcontext()
    try:
        with json_only:  # with --json, stdout is the JSON document's alone
            _run(args)
    except SystemExit as e:
        if e.code in (INTERRUPTED, TERMINATED) and "ray" in sys.modules:
            # A Ctrl-C or SIGTERM that stopped a run can leave Ray's threads mid-start
            # or mid-shutdown; the interpreter's teardown of them can crash (SIGSEGV
            # seen after the summary was out). Everything is written by now: leave.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.code)
        raise


def _run(args: list[str]) -> None:
    """Run the command and exit with its code; user errors and interrupts as one
    line on stderr (SystemExit leaves `main`'s --json block, which restores stdout)."""
    try:
        rv = cli.main(args=args, prog_name="trainlab", standalone_mode=False)
    except UserError as e:
        for line in e.lines:
            click.echo(f"error: {line}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        from trainlab.train.driver.interrupt import Interrupts

        click.echo("interrupted", err=True)
        sys.exit(Interrupts.exit_code())  # 130 after Ctrl-C, 143 after SIGTERM
    except OSError as e:  # a full disk, a read-only mount: one line, exit 74
        from trainlab.exitcodes import STORAGE_FAULT
        from trainlab.location.errors import refused_write

        line = refused_write(e)
        if line is None:
            raise
        click.echo(f"error: {line} (free space or fix the mount, then run it again)", err=True)
        sys.exit(STORAGE_FAULT)
    sys.exit(rv if isinstance(rv, int) else 0)
