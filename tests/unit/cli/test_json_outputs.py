"""`--json`: stdout is the JSON document alone, for every command that has it.

`trainlab.cli.main` sends everything else written to stdout (Ray's and Tune's
banners, worker output forwarded to the driver, child processes) to stderr. The
commands run here as real `python -m trainlab` processes; the Ray-backed ones
are parsed whole by the Ray tests that run them (`COVERED_ELSEWHERE`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from trainlab.cli import COMMANDS, cli

REPO = Path(__file__).resolve().parents[3]

# Run here (cheap: no Ray, no cluster).
CHECKED_HERE = {"plan", "runs", "compare", "gc", "cluster status"}
# Commands whose --json needs Ray, a cluster or a trained run: the test that
# parses their whole stdout as JSON.
PARSED_WHOLE_ELSEWHERE = {
    "train": "tests/ray/test_lifecycle.py",
    "tracking up": "tests/unit/track/test_tracking_server.py",
    "tracking down": "tests/unit/track/test_tracking_server.py",
    "tracking status": "tests/unit/track/test_tracking_server.py",
    "tracking import": "tests/unit/track/test_tracking_server.py",
}
# Run with --json by these tests, which parse the last stdout line (the same
# `trainlab.cli.main` path makes the rest of stdout go to stderr).
LAST_LINE_ELSEWHERE = {
    "prep": "tests/ray/test_prep_ray.py",
    "export": "tests/unit/export/test_export.py",
    "data inspect": "tests/unit/cli/test_data_cmd.py",
    "data at-step": "tests/unit/monitor/test_at_step.py",
    "submit": "tests/e2e/test_cluster_submit.py",
    "jobs": "tests/e2e/test_cluster_submit.py",
    "stop": "tests/e2e/test_cluster_submit.py",
    "cluster up": "tests/e2e/test_cluster_submit.py",
    "cluster down": "tests/e2e/test_cluster_submit.py",
    "cluster add-node": "tests/e2e/test_elastic.py",
    "mix swarm": "tests/ray/test_mix.py",
    "mix fit": "tests/unit/mix/test_cli.py",
    "mix propose": "tests/unit/mix/test_cli.py",
}
# No test runs these with --json yet (they go through the same `main`).
NOT_YET = {"tune", "mix confirm"}


def json_commands() -> list[str]:
    """Every command line (group and subcommand) that takes --json."""
    found = []
    ctx = click.Context(cli)

    def walk(cmd: click.Command, path: list[str]) -> None:
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                walk(cmd.get_command(ctx, name), [*path, name])
        elif any("--json" in p.opts for p in cmd.params):
            found.append(" ".join(path))

    walk(cli, [])
    return found


def trainlab(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainlab", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "trainers/recipes/tiny.yaml", "--json"],
        ["runs", "--json", "--runs-root", "{tmp}"],
        ["compare", "--json", "--runs-root", "{tmp}"],
        ["gc", "--json", "--dry-run", "--runs-root", "{tmp}"],
        ["cluster", "status", "--json"],
    ],
    ids=lambda a: " ".join(a[:2]) if a[0] == "cluster" else a[0],
)
def test_json_stdout_parses_whole(args, tmp_path):
    args = [a.format(tmp=tmp_path) for a in args]
    result = trainlab(*args, env={"MLFLOW_TRACKING_URI": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    json.loads(result.stdout)


def test_everything_else_written_to_stdout_goes_to_stderr(tmp_path):
    """A command that prints, writes to file descriptor 1 and runs a child process
    that writes to its stdout (as Ray's log forwarding, Tune's reporter and
    raylets do): with --json only the JSON is on stdout, the rest on stderr."""
    (tmp_path / "noisy_cmd.py").write_text(
        "import os, subprocess, sys, click\n"
        "from trainlab.cli.common import echo_json, json_option\n"
        "@click.command()\n@json_option\n"
        "def noisy(as_json):\n"
        "    print('banner from print')\n"
        "    os.write(1, b'raw write to fd 1\\n')\n"
        "    subprocess.run([sys.executable, '-c', 'print(\"child process output\")'])\n"
        "    echo_json({'ok': True})\n"
        "    print('after the JSON')\n"
    )
    code = (
        "import sys; import trainlab.cli as c; "
        "c.COMMANDS['noisy'] = 'noisy_cmd:noisy'; c.main(sys.argv[1:])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "noisy", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO / 'platform'}"},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"ok": True}
    for noise in ("banner from print", "raw write to fd 1", "child process output", "after"):
        assert noise in result.stderr


def test_every_json_command_is_checked_somewhere():
    """A command that gains --json must be added to a test that parses its stdout."""
    elsewhere = PARSED_WHOLE_ELSEWHERE | LAST_LINE_ELSEWHERE
    commands = json_commands()
    assert {c.split()[0] for c in commands} <= set(COMMANDS)
    known = CHECKED_HERE | set(elsewhere) | NOT_YET
    missing = [c for c in commands if c not in known]
    assert not missing, f"--json commands no test parses: {missing}"
    for command, path in elsewhere.items():
        assert "--json" in (REPO / path).read_text(), (command, path)
