"""Resuming a run in object storage never writes (or reads) outside the run's
checkpoint cache: a checkpoint.json in the store that lists `..` names or an
absolute name is refused whole, with an error naming it, before anything is
written (docs/security.md).

Checkpoints are crafted as an attacker with write access to the store would,
on a real S3-compatible server (moto's)."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath

import pytest

from trainlab.config import ExperimentConfig
from trainlab.errors import UserError
from trainlab.run import checkpoints as ckpts
from trainlab.run.checkpoints.store import CheckpointStore
from trainlab.run.location import RunLocation
from trainlab.train.driver.launcher import check_resumable

STEP = 8
RUN_KEY = "2026-12-03/unit"


def _meta(files: dict[str, bytes]) -> bytes:
    listed = {
        rel: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for rel, data in files.items()
    }
    return json.dumps({"step": STEP, "valid": True, "files": listed}).encode()


def _put(s3, bucket: str, files: dict[str, bytes]) -> None:
    prefix = f"runs/{RUN_KEY}/checkpoints/{ckpts.dir_name(STEP)}"
    for rel, data in files.items():
        # Under its literal key and where an HTTP path with `..` lands on the server.
        for key in {f"{prefix}/{rel}", posixpath.normpath(f"{prefix}/{rel}").lstrip("/")}:
            s3.put_object(Bucket=bucket, Key=key, Body=data)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{ckpts.META_FILE}", Body=_meta(files))


def _everything_under(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


@pytest.mark.parametrize(
    "hostile",
    ["../../../../../planted.txt", "state/../../../../../../planted.txt", "{tmp_path}/planted.txt"],
)
def test_a_checkpoint_naming_files_outside_is_refused(s3_env, tmp_path, hostile):
    s3, bucket = s3_env
    hostile = hostile.format(tmp_path=tmp_path)  # the absolute case: a file of the node
    loc = RunLocation.of(f"s3://{bucket}/runs/{RUN_KEY}", str(tmp_path / "scratch"))
    before = _everything_under(tmp_path)
    # The hostile file comes first and last in sorted order around a real payload.
    _put(s3, bucket, {"trainer.pt": b"weights", hostile: b"planted by the bucket"})
    cfg = ExperimentConfig.model_validate({"name": "unit"})
    with pytest.raises(UserError) as err:  # the driver, before any worker starts
        check_resumable(loc, cfg, "hash", data=None)
    assert f"s3://{bucket}/runs/{RUN_KEY}" in str(err.value)
    assert repr(hostile) in str(err.value) and "nothing was restored" in str(err.value)
    with pytest.raises(UserError, match="nothing was restored"):  # a worker, the same
        CheckpointStore(loc).fetch_newest()
    assert _everything_under(tmp_path) == before  # nothing written anywhere


def test_a_well_formed_checkpoint_with_nested_files_is_fetched(s3_env, tmp_path):
    s3, bucket = s3_env
    loc = RunLocation.of(f"s3://{bucket}/runs/{RUN_KEY}", str(tmp_path / "scratch"))
    _put(s3, bucket, {"trainer.pt": b"trainer", "state/__0_0.distcp": b"shard"})
    got = CheckpointStore(loc).fetch_newest()
    assert got.step == STEP and (got.path / "state/__0_0.distcp").read_bytes() == b"shard"
    assert got.path.is_relative_to(tmp_path / "scratch")
