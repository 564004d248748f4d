"""Finding the cluster the way a user expects (no cluster needed)."""

from __future__ import annotations

import os

import pytest

from trainlab.errors import UserError
from trainlab.rayjobs import client


def test_address_precedence(clean_env, monkeypatch):
    with pytest.raises(UserError, match="trainlab cluster up"):
        client.resolve_address(None)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # a GCS address: not the Jobs API
    with pytest.raises(UserError):
        client.resolve_address(None)
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265/")
    assert client.resolve_address(None) == "http://127.0.0.1:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8300")
    assert client.resolve_address(None) == "http://127.0.0.1:8300"
    assert client.resolve_address("127.0.0.1:9000") == "http://127.0.0.1:9000"
    with pytest.raises(UserError, match="dashboard URL"):
        client.resolve_address("ray://127.0.0.1:10001")


def test_an_unreachable_cluster_is_a_user_error(clean_env):
    from trainlab.rayjobs.localcluster import free_port

    with pytest.raises(UserError, match="cannot reach the Ray cluster"):
        client.connect(f"http://127.0.0.1:{free_port()}")


def test_cli_without_a_cluster_says_how_to_get_one(clean_env, repo):
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).parent / "trainlab")
    env = {**os.environ}
    sub = subprocess.run(
        [exe, "submit", "trainers/recipes/tiny.yaml", "--json"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sub.returncode == 2 and sub.stdout == ""
    assert sub.stderr.strip().splitlines()[-1].startswith("error: no Ray cluster given")
    bad = subprocess.run(
        [
            exe,
            "submit",
            "trainers/recipes/tiny.yaml",
            "--set",
            "model.num_heads=7",
            "--address",
            "http://127.0.0.1:9",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "model.num_heads = 7" in bad.stderr
    down = subprocess.run(
        [exe, "cluster", "down"], env=env, capture_output=True, text=True, timeout=60
    )
    assert down.returncode == 0 and "no local cluster is running" in down.stdout
