"""Local cluster bookkeeping without Ray: process groups are stopped by id (even
a process that ignores SIGTERM), and a recorded cluster whose head is gone is
not reported as running."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from trainlab.rayjobs import localcluster as lc

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def _group_of(code: str) -> int:
    # A parent and a child in one new session, like `ray start --block` and its raylet.
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {code!r}]); "
            "time.sleep(600)",
        ],
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while len(lc.group_members(parent.pid)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return parent.pid


def test_stop_group_ends_every_process_of_the_group_even_stubborn_ones():
    pgid = _group_of(STUBBORN)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        start = time.monotonic()
        lc.stop_group(pgid, grace_s=1.0)
        assert lc.group_members(pgid) == []
        assert time.monotonic() - start < 15
        assert bystander.poll() is None  # not in the group: untouched
    finally:
        bystander.kill()


def test_a_recorded_cluster_with_a_dead_head_is_not_running(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINLAB_HOME", str(tmp_path))
    pgid = _group_of("import time; time.sleep(600)")
    state = lc.ClusterState(
        gcs_address="127.0.0.1:1",
        dashboard_url="http://127.0.0.1:2",
        temp_dir=str(tmp_path / "ray"),
        nodes=[lc.NodeProc("head", pgid, "log", 4, str(tmp_path / "ray"))],
    )
    (tmp_path / "ray").mkdir()
    lc.state_path().write_text(json.dumps(state.to_json()))
    assert lc.read_state().dashboard_url == "http://127.0.0.1:2"
    lines = lc.how_to_submit(lc.read_state())
    assert "http://127.0.0.1:2" in lines[0] and any("trainlab submit" in ln for ln in lines)
    stopped = lc.cluster_down(remove_temp_dirs=True)
    assert stopped.head.pgid == pgid and lc.group_members(pgid) == []
    assert not lc.state_path().exists() and not (tmp_path / "ray").exists()
    assert lc.read_state() is None and lc.cluster_down() is None


def test_the_commands_we_suggest_run_from_where_the_user_is(repo, monkeypatch):
    """`cluster up` and `submit` print next steps; copied as printed, they must run,
    with this environment on PATH (`trainlab ...`) or not (`.venv/bin/trainlab ...`)."""
    import os
    import shlex
    from pathlib import Path

    venv_bin = str(Path(sys.executable).parent)
    others = [d for d in os.environ["PATH"].split(os.pathsep) if d != venv_bin]
    monkeypatch.chdir(repo)
    for path in (os.pathsep.join(others), os.pathsep.join([venv_bin, *others])):
        monkeypatch.setenv("PATH", path)
        cmd = lc.trainlab_command()
        assert (cmd == "trainlab") == (path.split(os.pathsep)[0] == venv_bin), cmd
        ran = subprocess.run(
            [*shlex.split(cmd), "cluster", "--help"], capture_output=True, text=True, timeout=60
        )
        assert ran.returncode == 0 and "Start or stop a local Ray cluster" in ran.stdout
