"""Shared storage for runs and checkpoints: paths and S3, the latter against a
real S3-compatible server (moto's) on 127.0.0.1."""

from __future__ import annotations

import os

import pytest

from trainlab.errors import UserError
from trainlab.jobs.localcluster import free_port
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
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    check_writable(resolve_storage(f"s3://{bucket}/p", endpoint_url=s3_server))
