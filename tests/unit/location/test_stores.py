"""Runs roots and datasets in storage: paths, S3 (against a real S3-compatible
server, moto's, on 127.0.0.1) and the filesystem Ray Train is given."""

from __future__ import annotations

import os

import pytest

from trainlab.errors import UserError
from trainlab.location import locate


def test_local_paths_resolve_against_the_base(tmp_path):
    where = locate("runs", base_dir=tmp_path)
    assert (where.is_local, where.path, where.uri) == (
        True,
        str(tmp_path / "runs"),
        str(tmp_path / "runs"),
    )
    assert locate(f"file://{tmp_path}/x").path == str(tmp_path / "x")
    where.check_writable()  # at the nearest folder there is: checking makes none
    assert not (tmp_path / "runs").exists() and list(tmp_path.iterdir()) == []
    (tmp_path / "runs").mkdir()
    where.check_writable()
    assert list((tmp_path / "runs").iterdir()) == []  # the probe deleted


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
        locate(target).check_writable()
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match="afile: not a directory"):
        locate(tmp_path / "afile" / "runs" / "x").check_writable()


@pytest.mark.parametrize("bad", ["hdfs://nn/x", "s3://", "s3://b/p?endpoint=x", "  "])
def test_unsupported_locations_are_refused(bad):
    with pytest.raises(UserError):
        locate(bad)


def test_s3_storage_round_trips_through_the_endpoint(s3_env, s3_server):
    s3, bucket = s3_env
    where = locate(f"s3://{bucket}/trainlab/runs")
    assert (where.is_local, where.path, where.describe()) == (
        False,
        f"{bucket}/trainlab/runs",
        f"s3://{bucket}/trainlab/runs (endpoint {s3_server})",
    )
    where.check_writable()
    # What Ray Train does with RunConfig(storage_path, storage_filesystem): write
    # a checkpoint directory through the filesystem, then list and read it back.
    fs, root = where.filesystem, where.path
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
        locate("s3://no-such-bucket/x").check_writable()


def test_gcs_problems_name_the_location(gcs_env, gcs_server):
    with pytest.raises(UserError, match=r"gs://no-such-bucket/x \(emulator .*not writable"):
        locate("gs://no-such-bucket/x").check_writable()
    locate(f"gs://{gcs_env}/x").check_writable()
