"""`trainlab cluster up` says trainlab's commands use its cluster: a Ray command
(`train`, `tune`, `prep`, `data`, `mix`) run while it is up connects to it
instead of starting a second, embedded cluster (train said "RAY_ADDRESS unset"),
and the address is named as Ray names it (`address`). Without Ray: the cluster's
head is a live process group recorded in the state file, as `cluster up` records
it; what the command then sets is what a driver of that cluster needs (checked
against a real cluster by hand: without RAY_AUTH_MODE=token or the loopback-only
mode, `ray.init` cannot connect)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.unit.rayjobs.test_localcluster import _group_of
from trainlab.cli import main
from trainlab.raycluster import LOCAL_CLUSTER_ENV
from trainlab.rayjobs import localcluster as lc
from trainlab.train.driver.startup import StartupNotes

RAY_VARS = ("RAY_ADDRESS", "RAY_AUTH_MODE", LOCAL_CLUSTER_ENV, *lc.SINGLE_MACHINE_ENV)


def unset_ray_vars(monkeypatch) -> None:
    """Unset, and restored after the test even though the CLI sets them itself
    (monkeypatch restores only what it saw set)."""
    for var in RAY_VARS:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)


@pytest.fixture(autouse=True)
def no_ray_in_this_process(monkeypatch):
    """The notes ask whether Ray is up in this process: an earlier test of the
    session may have started it in pytest's; these tests are about a new process."""
    monkeypatch.delitem(sys.modules, "ray", raising=False)


@pytest.fixture
def cluster(clean_env, monkeypatch, tmp_path):
    """A recorded local cluster whose head (a sleeping process group) is alive."""
    unset_ray_vars(monkeypatch)
    pgid = _group_of("import time; time.sleep(600)")
    state = lc.ClusterState(
        gcs_address="127.0.0.1:6399",
        dashboard_url="http://127.0.0.1:8299",
        temp_dir=str(tmp_path / "ray"),
        nodes=[lc.NodeProc("head", pgid, "log", 4, str(tmp_path / "ray"))],
    )
    lc.state_path().parent.mkdir(parents=True)
    lc.state_path().write_text(json.dumps(state.to_json()))
    yield state
    lc.stop_group(pgid, grace_s=1.0)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_a_ray_command_uses_the_running_local_cluster(cluster, capsys, tmp_path):
    code, out, _ = run(capsys, "cluster", "status", "--json")
    assert code == 0 and json.loads(out)["address"] == "127.0.0.1:6399"
    # Through the real CLI: the command fails on its missing config, after the
    # cluster was chosen (before Ray is imported: Ray reads these variables once).
    code, _, err = run(capsys, "train", str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err
    assert os.environ["RAY_ADDRESS"] == os.environ[LOCAL_CLUSTER_ENV] == "127.0.0.1:6399"
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert all(os.environ[k] == v for k, v in lc.SINGLE_MACHINE_ENV.items())
    # The driver's note says which cluster (trainlab.raycluster.ensure_ray says it
    # as it connects), not "connecting to the Ray cluster at ..." a second time.
    notes = StartupNotes(enabled=True)
    notes.ray()
    assert capsys.readouterr().err == ""


def test_only_ray_commands_and_never_over_the_users_ray_address(cluster, capsys, monkeypatch):
    run(capsys, "compare", "--json", "--runs-root", str(cluster.temp_dir))
    assert "RAY_ADDRESS" not in os.environ  # compare does not use Ray
    run(capsys, "train", "--help")
    assert "RAY_ADDRESS" not in os.environ
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    run(capsys, "train", "missing.yaml")
    assert os.environ["RAY_ADDRESS"] == "10.0.0.5:6379" and LOCAL_CLUSTER_ENV not in os.environ
    notes = StartupNotes(enabled=True)
    notes.ray()
    assert "connecting to the Ray cluster at 10.0.0.5:6379" in capsys.readouterr().err


def test_without_a_running_cluster_nothing_changes(clean_env, capsys, monkeypatch):
    unset_ray_vars(monkeypatch)
    run(capsys, "train", "missing.yaml")
    assert not any(v in os.environ for v in RAY_VARS)
    StartupNotes(enabled=True).ray()
    assert "starting a local Ray cluster (RAY_ADDRESS unset)" in capsys.readouterr().err


def test_an_older_state_file_without_address_still_reads(cluster):
    recorded = json.loads(lc.state_path().read_text())
    assert recorded["address"] == recorded["gcs_address"] == "127.0.0.1:6399"
    del recorded["address"]
    lc.state_path().write_text(json.dumps(recorded))
    assert lc.read_state().address == "127.0.0.1:6399"
