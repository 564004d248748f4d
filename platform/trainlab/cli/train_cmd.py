"""`trainlab train CONFIG [--set K=V ...] [--smoke] [--run-dir DIR [--create] | --resume] [--extend] [--json]`.

CONFIG is a config file, or with --resume a run directory (its config.yaml,
with --set overrides on top). Resuming a run that already completed prints so
and exits 0 without touching it; --extend continues it to a larger
train.total_steps (trainlab.run.dir)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from trainlab.cli.common import echo_json, json_option
from trainlab.exitcodes import STOPPED_BY_ALERT, STORAGE_FAULT
from trainlab.runstatus import RunStatus

# EX_TEMPFAIL: workers or nodes were lost beyond train.max_failures; a job retry may
# succeed (docs/contracts.md, section 6).
EXIT_INFRASTRUCTURE = 75


@click.command()
@click.argument("config", type=click.Path())
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config value, e.g. --set train.lr=1e-4 (repeatable).",
)
@click.option(
    "--smoke",
    is_flag=True,
    help="Short rehearsal: a few steps, a checkpoint, a worker killed and a "
    "validated resume. Run it before submitting a big job.",
)
@click.option(
    "--run-dir",
    "run_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Continue the run in this directory from its newest valid checkpoint (what "
    "a job retry passes); a DIR that does not exist is refused unless --create.",
)
@click.option(
    "--create",
    is_flag=True,
    help="With --run-dir: start a new run there when DIR does not exist yet (a run "
    "already in it is continued, as a job retry needs).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the most recent run of this config's name (or the run directory "
    "given as CONFIG) from its newest valid checkpoint; a completed run is left as it is.",
)
@click.option(
    "--extend",
    is_flag=True,
    help="With --resume/--run-dir: train the run past its total_steps, to the larger "
    "--set train.total_steps=N (recorded in logs/extensions.jsonl).",
)
@click.option(
    "--keep-smoke",
    is_flag=True,
    help="Keep the rehearsal's run directory after it passed (a failed one is always kept).",
)
@click.option(
    "--repeats",
    type=int,
    default=None,
    metavar="K",
    help="Run K seeds (data.seed, train.seed + 0..K-1) as one group, for the noise "
    "band `trainlab compare` shows (trainlab.repeats).",
)
@click.option(
    "--allow-env-drift",
    is_flag=True,
    help="Start even when a node's packages differ from the lock; the drift is recorded.",
)
@json_option
def train(
    config: str,
    overrides: tuple[str, ...],
    smoke: bool,
    run_dir: str | None,
    create: bool,
    resume: bool,
    extend: bool,
    keep_smoke: bool,
    repeats: int | None,
    allow_env_drift: bool,
    as_json: bool,
) -> int:
    """Train CONFIG on Ray Train: RAY_ADDRESS, else the running `trainlab cluster up`, else embedded.
    CONFIG may be a run directory with --resume (its config.yaml is used).

    Progress (step, loss, tokens/s, ETA) goes to stderr; with --json the last line
    of stdout is the run summary. Exit codes: 0 completed, 2 bad input, 1 failed
    (an error that would happen again), 74 failed because the run's disk failed a
    write (full, I/O error: free space, then resume), 75 failed because processes or workers
    were lost more often than train.max_failures allows (a retry may succeed), 130
    interrupted (Ctrl-C: during start-up it stops at once; once training, the first
    stops at the next step, with a checkpoint when there is none yet or the newest
    is older than train.checkpoint.on_interrupt_min_age_s, says what it keeps and
    drops, and prints the command that resumes the run; a second stops at once)."""
    from trainlab.config import load_config
    from trainlab.config.loader import require_record
    from trainlab.errors import UserError
    from trainlab.train import TrainingFailed, run

    if run_dir and resume:
        raise UserError("--run-dir and --resume: give one (--run-dir names the run to continue)")
    if smoke and (run_dir or resume):
        raise UserError(
            "--smoke always rehearses in a fresh run directory; drop --run-dir/--resume"
        )
    if extend and not (run_dir or resume):
        raise UserError("--extend continues an existing run: add --resume or --run-dir DIR")
    if create and not run_dir:
        raise UserError("--create starts a new run in --run-dir DIR: add --run-dir DIR")
    if run_dir and not create:  # a mistyped DIR would start a new run there
        from trainlab.run.dir import check_exists

        check_exists(run_dir)
    config, run_dir, resume = _config_of(config, run_dir, resume)
    # A run with --set changes is named after them, and CONFIG --resume with the same
    # flags finds it by that name; a run given by its directory keeps its name, and
    # so does --extend (its --set train.total_steps is the extension, not the name).
    cfg = load_config(config, overrides, name_from_overrides=not (run_dir or extend))
    if not smoke:
        require_record(cfg, config, "trainlab train")
    # A tracking server that refuses this environment's credentials: said now, before
    # any worker is placed (an unreachable one is not an error: the journal waits).
    from trainlab.track.server import check_credentials

    check_credentials()
    if allow_env_drift:  # trainlab.envlock.check_nodes records the drift instead
        os.environ["TRAINLAB_ALLOW_ENV_DRIFT"] = "1"
    if repeats is not None:
        from trainlab.cli.repeats import train_repeats

        flags = {"smoke": smoke, "run_dir": run_dir, "resume": resume, "extend": extend}
        return train_repeats(cfg, repeats, as_json, **flags)
    try:
        summary = run(cfg, run_dir=run_dir, resume=resume, smoke=smoke, extend=extend)
    except TrainingFailed as e:
        _print_failure(e.summary)
        if as_json:
            echo_json(e.summary)
        cause = e.summary.get("failure_cause")
        if cause == "storage":  # the disk failed a write: free space, then resume
            return STORAGE_FAULT
        return EXIT_INFRASTRUCTURE if cause == "infrastructure" else 1
    if summary.get("already_complete"):
        _print_complete(summary, cfg.train.total_steps)
        if as_json:
            echo_json(summary)
        return 0
    if summary.get("status") == RunStatus.INTERRUPTED:
        from trainlab.train.driver.interrupt import Interrupts

        _print_interrupted(summary)
        if as_json:
            echo_json(summary)
        return Interrupts.exit_code()  # 130 after Ctrl-C, 143 after SIGTERM
    if smoke and not keep_smoke:
        summary = clean_up_rehearsal(summary)
    _print_done(summary)
    if as_json:
        echo_json(summary)
    if summary.get("status") == RunStatus.STOPPED_BY_ALERT:  # deliberate: never retried
        click.echo(f"  stopped by alert: {summary.get('stop_reason')}", err=True)
        return STOPPED_BY_ALERT
    return 0


def _config_of(config: str, run_dir: str | None, resume: bool) -> tuple[str, str | None, bool]:
    """(config file, --run-dir, --resume) for CONFIG: a run (its directory, or a run
    in object storage, whose config.yaml is fetched into this node's working copy)
    given with --resume stands for `RUN/config.yaml --run-dir RUN`."""
    from trainlab.errors import UserError
    from trainlab.run.dir import config_or_run

    path, run = config_or_run(config, "CONFIG")
    if run is None:  # a config file
        return config, run_dir, resume
    if not resume:
        raise UserError(f"{config}: is a run; to continue it: trainlab train {config} --resume")
    return str(path), run.uri, False


def run_label(s: dict) -> str:
    """What a summary's lines call the run: its run directory's name (`tiny-2` when
    `tiny` was taken, as its MLflow run is named), not the config's name."""
    run_dir = str(s.get("run_dir") or "").rstrip("/")
    return run_dir.rsplit("/", 1)[-1] if run_dir else str(s.get("name"))


def _print_complete(s: dict, total_steps: int) -> None:
    click.echo(
        f"{run_label(s)}: already completed at step {s.get('final_step')} of {total_steps}; "
        "nothing to do, the run is left as it is",
        err=True,
    )
    click.echo(f"  run dir: {s.get('run_dir')}", err=True)
    click.echo(
        f"  to train it longer: trainlab train {s.get('run_dir')} --resume --extend "
        "--set train.total_steps=N",
        err=True,
    )


def clean_up_rehearsal(summary: dict) -> dict:
    """Delete the run directory of a smoke rehearsal that passed (its checkpoints
    are the size of the real run's) and its MLflow run (deleted as MLflow deletes:
    out of `runs`, `compare`, the UI and the notebooks, which would otherwise set a
    6-step rehearsal beside the real runs); a failed one is kept, with its record,
    to diagnose. Returns the summary with `run_dir_removed`."""
    import shutil
    from pathlib import Path

    smoke = summary.get("smoke") or {}
    passed = summary.get("status") == RunStatus.COMPLETED and all(smoke.get("checks", {}).values())
    # Its records that wait for the MLflow store live in it (logs/mlflow-journal.jsonl).
    passed = passed and not summary.get("records_pending")
    run_dir = Path(str(summary.get("run_dir") or ""))
    if not (passed and smoke and run_dir.name and (run_dir / "config.yaml").is_file()):
        return {**summary, "run_dir_removed": False}
    shutil.rmtree(run_dir)
    _delete_record(run_dir)
    day = run_dir.parent
    if day.is_dir() and not any(day.iterdir()):
        day.rmdir()
    # Its checkpoints went with it: no path in the summary points at them.
    gone = {k: None for k in ("last_checkpoint", "best_checkpoint") if k in summary}
    return {**summary, **gone, "run_dir_removed": True}


def _delete_record(run_dir: Path) -> None:
    """Delete the MLflow run of the run directory `run_dir` (found by its run_key
    in the store of its runs root), if the store has one."""
    import logging

    from trainlab.track.backend import client_for, tracking_uri
    from trainlab.track.journal import run_key

    try:
        client = client_for(tracking_uri(run_dir.parent.parent), flush_records=False)
        ids = [e.experiment_id for e in client.search_experiments()]
        key = run_key(str(run_dir))
        for run in client.search_runs(ids, filter_string=f"tags.run_key = '{key}'"):
            client.delete_run(run.info.run_id)
    except Exception as e:  # noqa: BLE001 - the rehearsal passed; its record is secondary
        logging.getLogger(__name__).warning("could not delete the rehearsal's MLflow run: %s", e)


def _print_done(s: dict) -> None:
    loss = f"{s['final_loss']:.4f}" if s.get("final_loss") is not None else "n/a"
    val = f"{s['val_loss']:.4f}" if s.get("val_loss") is not None else "n/a"
    pending = s.get("records_pending") or 0
    status = f"{s['status']}, records not all in the MLflow store" if pending else s["status"]
    click.echo(
        f"{run_label(s)}: {status} at step {s['final_step']} (loss {loss}, val_loss "
        f"{val}, restarts {s['restarts']}, {s['wall_seconds']:.0f} s)",
        err=True,
    )
    _print_pending(s)
    removed = " (removed: the rehearsal passed; --keep-smoke keeps it)"
    click.echo(
        f"  run dir:         {s.get('run_dir')}{removed if s.get('run_dir_removed') else ''}",
        err=True,
    )
    if s.get("run_dir_removed"):
        click.echo("  checkpoints:     removed with the run directory", err=True)
    else:
        click.echo(f"  last checkpoint: {s.get('last_checkpoint')}", err=True)
        click.echo(f"  best checkpoint: {s.get('best_checkpoint')}", err=True)
    if "smoke" in s:
        checks = ", ".join(k for k, ok in s["smoke"]["checks"].items() if ok)
        click.echo(f"  smoke checks passed: {checks}", err=True)
        from trainlab.train.loop.metrics import memory_gap

        gap = memory_gap(s.get("planned_memory_bytes"), s.get("peak_memory_bytes"))
        if gap:
            click.echo(f"  memory per device: {gap}", err=True)


def _print_interrupted(s: dict) -> None:
    """A Ctrl-C'd run: where it stopped, what it keeps and what it drops (an early
    Ctrl-C: no checkpoint at the stop), and the exact command that continues it."""
    step, resume = s.get("final_step"), s.get("resume_step")
    checkpoint = s.get("last_checkpoint")
    click.echo(f"{run_label(s)}: interrupted at step {step}", err=True)
    click.echo(f"  run dir:         {s.get('run_dir')}", err=True)
    kept = resume if resume is not None else step
    if s.get("checkpoint_unknown"):  # the run's storage did not answer at the stop
        click.echo(
            "  kept:            not known now (the run's storage did not answer): a resume "
            "continues from the newest valid checkpoint",
            err=True,
        )
    elif checkpoint and kept:
        click.echo(f"  kept:            step {kept} ({checkpoint})", err=True)
    else:
        click.echo(
            "  kept:            nothing yet (no checkpoint: a resume starts at step 0)", err=True
        )
    dropped = s.get("dropped_steps")
    if dropped:
        click.echo(
            f"  dropped:         steps {dropped[0]}-{dropped[1]} (no checkpoint at the stop: the "
            "newest was younger than train.checkpoint.on_interrupt_min_age_s); a resume "
            "redoes them",
            err=True,
        )
    click.echo(f"  resume with:     trainlab train {s.get('run_dir')} --resume", err=True)
    _print_pending(s)


def _print_pending(s: dict) -> None:
    """The run's records that wait for the MLflow store, and how to write them."""
    pending = s.get("records_pending") or 0
    if pending:
        click.echo(
            f"  records pending: {pending} wait in {s.get('run_dir')}/logs/mlflow-journal.jsonl "
            f"(the MLflow store did not answer); `trainlab track-flush {s.get('run_dir')}` "
            "or any command that opens the store (trainlab runs) writes them",
            err=True,
        )


def _print_failure(s: dict) -> None:
    click.echo(f"{run_label(s)}: FAILED: {s.get('error')}", err=True)
    _print_pending(s)
    for f in s.get("failures", []):
        step = f.get("step") if f.get("step") is not None else "?"
        click.echo(f"  failure: step {step}, rank {f.get('rank')}: {f.get('error')}", err=True)
    click.echo(f"  run dir: {s.get('run_dir')}", err=True)
    if s.get("last_checkpoint"):
        click.echo(
            f"  resume with: --run-dir {s.get('run_dir')} (newest valid checkpoint "
            f"{s['last_checkpoint']})",
            err=True,
        )
    sys.stderr.flush()
