"""Shared storage for runs and checkpoints: paths and S3, the latter against a
real S3-compatible server (moto's) on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trainlab.errors import UserError
from trainlab.storage import check_writable, resolve_storage


def test_local_paths_resolve_against_the_base(tmp_path):
    s = resolve_storage("runs", base_dir=tmp_path)
    assert (s.kind, s.path, s.is_shared) == ("local", str(tmp_path / "runs"), False)
    kwargs = s.run_config_kwargs()
    assert kwargs["storage_path"] == str(tmp_path / "runs")
    assert resolve_storage(f"file://{tmp_path}/x").path == str(tmp_path / "x")
    check_writable(s)
    assert (tmp_path / "runs").is_dir() and not list((tmp_path / "runs").iterdir())


def test_read_only_storage_is_a_user_error(tmp_path):
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_text("")
        target = blocker / "runs"  # a path below a regular file cannot be created
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        target = ro / "runs"
    with pytest.raises(UserError, match="not writable"):
        check_writable(resolve_storage(target))


@pytest.mark.parametrize("bad", ["gs://bucket/x", "s3://", "s3://b/p?endpoint=x", "  "])
def test_unsupported_locations_are_refused(bad):
    with pytest.raises(UserError):
        resolve_storage(bad)


def _free_port() -> int:
    from trainlab.jobs.localcluster import free_port

    return free_port()


@pytest.fixture(scope="module")
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


def test_s3_storage_round_trips_through_the_endpoint(s3_env, s3_server):
    s3, bucket = s3_env
    s = resolve_storage(f"s3://{bucket}/trainlab/runs")
    assert (s.kind, s.path, s.endpoint_url, s.is_shared) == (
        "s3",
        f"{bucket}/trainlab/runs",
        s3_server,
        True,
    )
    check_writable(s)
    # What Ray Train does with RunConfig(storage_path, storage_filesystem): write
    # a checkpoint directory through the filesystem, then list and read it back.
    kw = s.run_config_kwargs()
    fs, root = kw["storage_filesystem"], kw["storage_path"]
    fs.create_dir(f"{root}/tiny/checkpoints/step-00000020")
    with fs.open_output_stream(f"{root}/tiny/checkpoints/step-00000020/model.pt") as f:
        f.write(b"weights")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert "trainlab/runs/tiny/checkpoints/step-00000020/model.pt" in keys
    assert not [k for k in keys if ".trainlab-probe-" in k]  # the probe cleaned up
    body = s3.get_object(
        Bucket=bucket, Key="trainlab/runs/tiny/checkpoints/step-00000020/model.pt"
    )["Body"]
    assert body.read() == b"weights"


def test_s3_problems_name_the_location(s3_env):
    with pytest.raises(UserError, match=r"s3://no-such-bucket/x .*not writable"):
        check_writable(resolve_storage("s3://no-such-bucket/x"))


def test_an_explicit_endpoint_wins_over_the_environment(s3_env, s3_server, monkeypatch):
    s3, bucket = s3_env
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    check_writable(resolve_storage(f"s3://{bucket}/p", endpoint_url=s3_server))
