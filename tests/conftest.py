"""Shared fixtures. Unit tests (tests/unit) never start Ray; tests under
tests/ray and tests/e2e share ONE local Ray cluster per session (starting one
costs 5-9 s), through the `ray_cluster` fixture."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.trackserver import tracking_server  # noqa: F401 - the session's tracking server

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "trainers" / "recipes"

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# trainlab's local state (the cluster of `trainlab cluster up`, which the Ray
# commands use while it runs: trainlab.cli.localray) is the session's own, never
# that of whoever runs the tests on this machine.
os.environ["TRAINLAB_HOME"] = tempfile.mkdtemp(prefix="trainlab-tests-home-")
atexit.register(shutil.rmtree, os.environ["TRAINLAB_HOME"], True)


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray cluster (8 logical CPUs on a 2-core machine; see
    docs/ray-resources.md on why fewer deadlocks Ray Train + Ray Data)."""
    import ray

    from trainlab.raycluster import ensure_ray

    os.environ.pop("RAY_ADDRESS", None)
    resources = ensure_ray(num_cpus=8)
    yield resources
    ray.shutdown()


@pytest.fixture
def repo() -> Path:
    return REPO


# --------------------------------------------------------------------------- S3
# A real S3-compatible server (moto's) on 127.0.0.1, for storage and prep tests.


def _free_port() -> int:
    from trainlab.rayjobs.localcluster import free_port

    return free_port()


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3-compatible server as a real HTTP server on 127.0.0.1."""
    port = _free_port()
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=s3_server)
    bucket = f"ckpt-{time.monotonic_ns()}"
    s3.create_bucket(Bucket=bucket)
    return s3, bucket


# --------------------------------------------------------------------------- GCS
# A real Google Cloud Storage emulator (the gcp-storage-emulator package) on
# 127.0.0.1, reached as Google's clients do: STORAGE_EMULATOR_HOST.


@pytest.fixture(scope="session")
def gcs_server():
    """The emulator as a real HTTP server on 127.0.0.1 (objects in memory)."""
    port = _free_port()
    exe = Path(sys.executable).parent / "gcp-storage-emulator"
    proc = subprocess.Popen(
        [str(exe), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b?project=test", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("gcp-storage-emulator did not start") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def make_gcs_bucket(server: str, prefix: str = "gcs") -> str:
    """A new, empty bucket in the emulator at `server` (its JSON API)."""
    import json as _json

    bucket = f"{prefix}-{time.monotonic_ns()}"
    req = urllib.request.Request(
        f"{server}/storage/v1/b?project=test",
        data=_json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(req, timeout=10).read()
    return bucket


@pytest.fixture
def gcs_env(gcs_server, monkeypatch):
    """STORAGE_EMULATOR_HOST set for this test, and a new bucket."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "test")
    return make_gcs_bucket(gcs_server)
