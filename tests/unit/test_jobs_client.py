"""Finding the cluster and its token the way a user expects (no cluster needed)."""

from __future__ import annotations

import os
import stat

import pytest

from trainlab.errors import UserError
from trainlab.jobs import client


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRAINLAB_HOME", str(tmp_path / "trainlab"))
    return tmp_path


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


def test_token_lookup_follows_rays_order(clean_env, monkeypatch):
    assert client.auth_token() is None and client.auth_headers() == {}
    default = client.default_token_path()
    default.parent.mkdir(parents=True)
    default.write_text("from-file\n")
    assert client.auth_headers() == {"Authorization": "Bearer from-file"}
    other = clean_env / "tok"
    other.write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(other))
    assert client.auth_token() == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert client.auth_token() == "from-env"
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(clean_env / "missing"))
    with pytest.raises(UserError, match="RAY_AUTH_TOKEN_PATH"):
        client.auth_token()


def test_ensure_token_creates_a_private_token_and_never_replaces_one(clean_env):
    written = client.ensure_token()
    assert written == client.default_token_path()
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
    token = written.read_text()
    assert len(token) == 64
    assert client.ensure_token() is None  # other clusters on this machine use it
    assert written.read_text() == token


def test_an_unreachable_cluster_is_a_user_error(clean_env):
    from trainlab.jobs.localcluster import free_port

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
