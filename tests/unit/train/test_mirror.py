"""Checkpoint copies on `resource.storage` (S3 through a real S3-compatible server,
moto's, on 127.0.0.1): written as retention keeps them, restored when the run
directory lost them, and never trusted when incomplete or corrupted."""

from __future__ import annotations

import logging
import shutil

from tests.train_helpers import dataset_dir, local_loader, make_job, tiny_config
from trainlab.train import checkpoint as ck
from trainlab.train.checkpoint.mirror import CheckpointMirror
from trainlab.train.driver.launcher import restore_from_storage
from trainlab.train.loop.callbacks import Callback, CallbackList
from trainlab.train.loop.trainer import Trainer
from trainlab.train.parallel.distributed import DistEnv


class StopAt(Callback):
    """Asks the run to stop at `step` (as an operator or a P0 alert would)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, step, metrics):
        if step >= self.step:
            self.stop_requested, self.stop_reason = True, "test asked"


def _train(cfg, run_dir, stop_at: int | None = None):
    job = make_job(cfg, run_dir)
    callbacks = CallbackList([StopAt(stop_at)]) if stop_at else None
    return Trainer(job, local_loader(job), DistEnv(), callbacks).fit()


def _copies(s3, bucket: str, run_dir) -> dict[int, set[str]]:
    """step -> file names of each checkpoint copy in the bucket."""
    prefix = f"runs/{run_dir.parent.name}/{run_dir.name}/checkpoints/"
    out: dict[int, set[str]] = {}
    for obj in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
        step_dir, _, name = obj["Key"][len(prefix) :].partition("/")
        if name:  # not a directory marker
            out.setdefault(ck.parse_step(step_dir), set()).add(name)
    return out


def test_copies_follow_retention_and_a_lost_run_dir_resumes_from_them(
    s3_env, tmp_path_factory, tmp_path
):
    s3, bucket = s3_env
    dataset = dataset_dir(tmp_path_factory)
    storage = {"resource": {"storage": f"s3://{bucket}/runs"}}
    run_dir = tmp_path / "2026-12-03" / "unit"
    cfg = tiny_config(dataset, train={"total_steps": 24}, **storage)
    summary = _train(cfg, run_dir, stop_at=16)
    assert summary["final_step"] == 16

    local = {i.step for i in ck.committed(run_dir / "checkpoints")}
    copies = _copies(s3, bucket, run_dir)
    assert set(copies) == local and 16 in local  # keep_last 2 + keep_best 1, as on disk
    assert all(ck.META_FILE in files and len(files) > 1 for files in copies.values())

    # The run directory's checkpoints are lost (a new cluster, a wiped disk).
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").mkdir()
    assert restore_from_storage(cfg, run_dir) == [16]
    info = ck.find_resume(run_dir / "checkpoints")
    assert info is not None and info.step == 16 and ck.verify(info) is None

    resumed = _train(cfg, run_dir)
    assert (resumed["start_step"], resumed["final_step"]) == (16, 24)
    # Deterministic mode: the same weights as a run that was never interrupted.
    straight = _train(cfg, tmp_path / "2026-12-03" / "straight")
    assert resumed["weights_sha256"] == straight["weights_sha256"]
    assert 24 in _copies(s3, bucket, run_dir)


def test_incomplete_or_corrupted_copies_are_never_restored(s3_env, tmp_path_factory, tmp_path):
    s3, bucket = s3_env
    dataset = dataset_dir(tmp_path_factory)
    cfg = tiny_config(
        dataset,
        train={"total_steps": 12, "checkpoint": {"keep_last": 3, "keep_best": 0}},
        resource={"storage": f"s3://{bucket}/runs"},
    )
    run_dir = tmp_path / "2026-12-03" / "unit"
    _train(cfg, run_dir)
    prefix = "runs/2026-12-03/unit/checkpoints"
    assert set(_copies(s3, bucket, run_dir)) == {4, 8, 12}

    # Step 12's copy is corrupted; step 8's lost its metadata (an upload cut off).
    (payload,) = [
        o["Key"]
        for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step-00000012/")["Contents"]
        if o["Key"].endswith(".pt")
    ][:1]
    s3.put_object(Bucket=bucket, Key=payload, Body=b"not the weights")
    s3.delete_object(Bucket=bucket, Key=f"{prefix}/step-00000008/{ck.META_FILE}")

    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").mkdir()
    assert restore_from_storage(cfg, run_dir) == [4]
    assert [i.step for i in ck.committed(run_dir / "checkpoints")] == [4]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]


def test_an_unreachable_storage_never_stops_training(
    s3_env, tmp_path_factory, tmp_path, monkeypatch, caplog
):
    from trainlab.jobs.localcluster import free_port

    _, bucket = s3_env
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody there
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    cfg = tiny_config(
        dataset_dir(tmp_path_factory),
        train={"total_steps": 8},
        resource={"storage": f"s3://{bucket}/runs"},
    )
    with caplog.at_level(logging.WARNING, logger="trainlab.train.checkpoint.mirror"):
        summary = _train(cfg, tmp_path / "2026-12-03" / "unit")
    assert (summary["status"], summary["final_step"]) == ("completed", 8)
    assert any("copying checkpoints to s3://" in r.getMessage() for r in caplog.records)


def test_a_local_path_works_as_storage(tmp_path_factory, tmp_path):
    cfg = tiny_config(
        dataset_dir(tmp_path_factory),
        train={"total_steps": 8},
        resource={"storage": str(tmp_path / "durable")},
    )
    run_dir = tmp_path / "runs" / "2026-12-03" / "unit"
    _train(cfg, run_dir)
    mirror = CheckpointMirror.for_run(str(tmp_path / "durable"), run_dir)
    assert mirror.steps() == [4, 8]
    assert (tmp_path / "durable/2026-12-03/unit/checkpoints/step-00000008" / ck.META_FILE).is_file()
