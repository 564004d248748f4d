"""trainlab.envlock: the fingerprint of this process and the lines a node
off its lock produces (the node check's message), against the real lock files."""

from __future__ import annotations

import json

from trainlab import envlock as env


def test_this_venv_fingerprint_names_its_lock_and_versions():
    fp = env.fingerprint()
    assert fp["lock"] == "cpu" and fp["torch"].endswith("+cpu") and fp["cuda"] is None
    assert fp["ray"] == env.read_lock(env.lock_path("cpu"))["ray"]
    assert env.local_drift() == []


def test_a_node_off_its_lock_is_named_with_each_package():
    mine = env.fingerprint()
    names = env.runtime_names()
    ok = {**mine, "node_ip": "10.0.0.6", "node_id": "aaaa1111"}
    bad = {**mine, "node_ip": "10.0.0.7", "node_id": "bbbb2222"}
    bad["packages"] = {**mine["packages"], "torch": "2.12.1+cpu", "pathspec": "0.0.1"}
    del bad["packages"]["filelock"]
    lock = env.read_lock(env.lock_path("cpu"))
    assert env.node_drift([ok, bad], names) == [
        f"node 10.0.0.7: filelock not installed != {lock['filelock']} (lock)",
        f"node 10.0.0.7: pathspec 0.0.1 != {lock['pathspec']} (lock)",
        f"node 10.0.0.7: torch 2.12.1+cpu != {lock['torch']} (lock)",
    ]
    # Nodes sharing an address (one machine) are told apart by their ids.
    same = {**bad, "node_ip": "10.0.0.6"}
    assert env.node_drift([ok, same], names)[0].startswith("node 10.0.0.6 (bbbb2222): ")
    # A dev tool (not a runtime package) differing is no drift.
    dev = {**ok, "packages": {**mine["packages"], "pytest": "1.0"}}
    assert env.node_drift([dev], names) == []


def test_the_run_record_of_the_environment(tmp_path):
    summary = env.write_run_environment(tmp_path, drift_lines=["node x: a 1 != 2 (lock)"])
    assert json.loads((tmp_path / env.ENV_FILE).read_text()) == summary
    assert summary["drift"] == ["node x: a 1 != 2 (lock)"] and summary["git_commit"]
    assert summary["lock_sha256"] == env.file_sha256(env.lock_path("cpu"))
    assert "torch==" in (tmp_path / env.PACKAGES_FILE).read_text()
    assert env.run_environment(tmp_path) == summary
    assert env.mlflow_tags(summary)["env.torch"] == summary["torch"]
