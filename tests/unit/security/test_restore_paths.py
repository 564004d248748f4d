"""Restoring checkpoint copies from `resource.storage` never writes (or reads)
outside the run directory: a copy whose checkpoint.json lists `..` names, an
absolute name, or whose files or directory are symlinks leading out is refused
whole, with an error naming it, before anything is written (docs/security.md).

Copies are crafted as an attacker with write access to the storage would: on
a real S3-compatible server (moto's) and on a local filesystem storage."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath

import pytest

from trainlab.config import ExperimentConfig
from trainlab.errors import UserError
from trainlab.train import checkpoint as ck
from trainlab.train.driver.launcher import restore_from_storage

STEP = 8
RUN_KEY = "2026-12-03/unit"


def _cfg(storage: str) -> ExperimentConfig:
    return ExperimentConfig.model_validate({"name": "unit", "resource": {"storage": storage}})


def _meta(files: dict[str, bytes]) -> bytes:
    listed = {
        rel: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for rel, data in files.items()
    }
    return json.dumps({"step": STEP, "valid": True, "files": listed}).encode()


def _run_dir(tmp_path):
    run_dir = tmp_path / "runs" / RUN_KEY
    (run_dir / "checkpoints").mkdir(parents=True)
    return run_dir


def _put_s3_copy(s3, bucket: str, files: dict[str, bytes]) -> None:
    prefix = f"runs/{RUN_KEY}/checkpoints/{ck.dir_name(STEP)}"
    for rel, data in files.items():
        # Under its literal key and where an HTTP path with `..` lands on the server.
        for key in {f"{prefix}/{rel}", posixpath.normpath(f"{prefix}/{rel}").lstrip("/")}:
            s3.put_object(Bucket=bucket, Key=key, Body=data)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{ck.META_FILE}", Body=_meta(files))


def _everything_under(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


@pytest.mark.parametrize(
    "hostile",
    ["../../../../../planted.txt", "state/../../../../../../planted.txt", "{tmp_path}/planted.txt"],
)
def test_a_copy_naming_files_outside_the_run_directory_is_refused(s3_env, tmp_path, hostile):
    s3, bucket = s3_env
    hostile = hostile.format(tmp_path=tmp_path)  # the absolute case: a file of the node
    run_dir = _run_dir(tmp_path)
    before = _everything_under(tmp_path)
    # The hostile file comes first and last in sorted order around a real payload.
    _put_s3_copy(s3, bucket, {"model.pt": b"weights", hostile: b"planted by the bucket"})

    with pytest.raises(UserError) as err:
        restore_from_storage(_cfg(f"s3://{bucket}/runs"), run_dir)
    message = str(err.value)
    assert f"s3://{bucket}/runs/{RUN_KEY}/checkpoints/{ck.dir_name(STEP)}" in message
    assert repr(hostile) in message and "nothing was restored" in message
    # Nothing written anywhere: not the planted file, not the payload, no staging left.
    assert _everything_under(tmp_path) == before
    assert list((run_dir / "checkpoints").iterdir()) == []


def test_a_well_formed_copy_with_nested_files_is_restored(s3_env, tmp_path):
    s3, bucket = s3_env
    run_dir = _run_dir(tmp_path)
    files = {"trainer.pt": b"trainer", "state/__0_0.distcp": b"shard"}
    _put_s3_copy(s3, bucket, files)
    assert restore_from_storage(_cfg(f"s3://{bucket}/runs"), run_dir) == [STEP]
    restored = run_dir / "checkpoints" / ck.dir_name(STEP)
    assert (restored / "state/__0_0.distcp").read_bytes() == b"shard"


def _local_copy(storage, files: dict[str, bytes]):
    copy = storage / RUN_KEY / "checkpoints" / ck.dir_name(STEP)
    copy.mkdir(parents=True)
    for rel, data in files.items():
        (copy / rel).write_bytes(data)
    (copy / ck.META_FILE).write_bytes(_meta(files))
    return copy


def test_a_symlinked_file_in_a_local_copy_is_not_followed_out(tmp_path):
    """A copy on a shared filesystem whose `model.pt` is a symlink to a file of the
    node (here a key file) would copy that file into the run directory."""
    secret = tmp_path / "node-private-key"
    secret.write_bytes(b"-----BEGIN PRIVATE KEY-----")
    storage = tmp_path / "durable"
    copy = _local_copy(storage, {"trainer.pt": b"trainer"})
    (copy / "model.pt").symlink_to(secret)
    (copy / ck.META_FILE).write_bytes(
        _meta({"trainer.pt": b"trainer", "model.pt": secret.read_bytes()})
    )
    run_dir = _run_dir(tmp_path)

    with pytest.raises(UserError, match=r"'model.pt' leads outside .*node-private-key"):
        restore_from_storage(_cfg(str(storage)), run_dir)
    assert list((run_dir / "checkpoints").iterdir()) == []


def test_a_symlinked_copy_directory_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _local_copy(elsewhere, {"model.pt": b"weights"})
    storage = tmp_path / "durable"
    (storage / RUN_KEY / "checkpoints").mkdir(parents=True)
    (storage / RUN_KEY / "checkpoints" / ck.dir_name(STEP)).symlink_to(
        elsewhere / RUN_KEY / "checkpoints" / ck.dir_name(STEP)
    )
    run_dir = _run_dir(tmp_path)
    with pytest.raises(UserError, match="the copy's directory"):
        restore_from_storage(_cfg(str(storage)), run_dir)
    assert list((run_dir / "checkpoints").iterdir()) == []


def test_a_local_checkpoint_listing_outside_files_is_never_uploaded(tmp_path, caplog):
    """The other direction: a checkpoint on a shared run directory whose
    checkpoint.json names a file outside it (here a node's key file) is not copied
    to the storage; training goes on (the copy is logged as failed)."""
    import logging

    from trainlab.train.checkpoint.mirror import CheckpointMirror

    secret = tmp_path / "node-private-key"
    secret.write_bytes(b"-----BEGIN PRIVATE KEY-----")
    run_dir = _run_dir(tmp_path)
    staging = run_dir / "checkpoints" / f"{ck.STAGING_PREFIX}{ck.dir_name(STEP)}"
    staging.mkdir()
    (staging / "model.pt").write_bytes(b"weights")
    info = ck.commit(staging, run_dir / "checkpoints" / ck.dir_name(STEP), {"step": STEP}, None)
    meta = json.loads((info.path / ck.META_FILE).read_text())
    hostile = "../../../../../node-private-key"
    meta["files"][hostile] = json.loads(_meta({hostile: secret.read_bytes()}))["files"][hostile]
    (info.path / ck.META_FILE).write_text(json.dumps(meta))

    storage = tmp_path / "durable"
    mirror = CheckpointMirror.for_run(str(storage), run_dir)
    with caplog.at_level(logging.WARNING, logger="trainlab.train.checkpoint.mirror"):
        mirror.safe_sync(run_dir / "checkpoints", keep_last=2, keep_best=1)
    assert f"{hostile!r} leads outside" in caplog.text
    uploaded = _everything_under(storage) if storage.exists() else set()
    assert not any(b"PRIVATE KEY" in (storage / p).read_bytes() for p in uploaded)
    assert mirror.steps() == []
