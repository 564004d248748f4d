"""Checkpoint manager without Ray: atomic commits, validation marks, corrupted
newest skipped, retention keep_last + keep_best, weights_only loading."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest
import torch

from trainlab.run import checkpoints as ckpts
from trainlab.train import checkpoint as ck


def write_checkpoint(
    root: Path, step: int, val_loss: float | None = 1.0, ok: bool = True, world_size: int = 1
) -> ckpts.CheckpointInfo:
    writer = ck.CheckpointWriter(root, 0, world_size, keep_last=100, keep_best=0, async_save=False)
    for r in range(1, world_size):  # the other ranks' parts, as they would write them
        staging = writer.staging_dir(step)
        ck.save_file({"rank": r}, staging / f"rng-rank{r}.pt")
        ck.write_done_marker(staging, r)

    def files(staging: Path) -> None:
        ck.save_file({"w": torch.full((3,), float(step))}, staging / "model.pt")

    def validator(staging: Path) -> ckpts.Validation:
        return ckpts.Validation(ok=ok, loss=val_loss, error=None if ok else "loss is nan")

    writer.submit(step, files, {"step": step}, validator)
    (info,) = writer.completed()
    return info


def test_commit_writes_metadata_last_and_renames_into_place(tmp_path):
    info = write_checkpoint(tmp_path, 20, world_size=2)
    assert info.path == tmp_path / "step-00000020"
    meta = json.loads((info.path / "checkpoint.json").read_text())
    assert meta["valid"] is True and meta["step"] == 20
    assert set(meta["files"]) == {"model.pt", "rng-rank1.pt"}
    assert not list(tmp_path.glob(".tmp-*"))
    assert not list(info.path.glob(".done-*"))
    assert ckpts.verify(info) is None


def test_half_written_checkpoint_is_invisible_and_cleaned(tmp_path):
    write_checkpoint(tmp_path, 10)
    staging = tmp_path / ".tmp-step-00000020"
    staging.mkdir()
    ck.save_file({"w": torch.zeros(2)}, staging / "model.pt")  # killed before commit
    assert [i.step for i in ckpts.committed(tmp_path)] == [10]
    assert ckpts.find_resume(tmp_path).step == 10
    ckpts.clean_staging(tmp_path)
    assert not staging.exists()


def test_resume_skips_a_corrupted_newest_checkpoint_with_a_warning(tmp_path, caplog):
    write_checkpoint(tmp_path, 10)
    newest = write_checkpoint(tmp_path, 20)
    with open(newest.path / "model.pt", "r+b") as f:  # flip bytes in the middle
        f.seek(40)
        f.write(b"\x00garbage\x00")
    with caplog.at_level(logging.WARNING):
        chosen = ckpts.find_resume(tmp_path)
    assert chosen.step == 10
    assert "step-00000020" in caplog.text and "sha256" in caplog.text


def test_resume_skips_truncated_unreadable_and_invalid_checkpoints(tmp_path, caplog):
    write_checkpoint(tmp_path, 10)
    truncated = write_checkpoint(tmp_path, 20)
    (truncated.path / "model.pt").write_bytes(b"")
    broken_meta = write_checkpoint(tmp_path, 30)
    (broken_meta.path / "checkpoint.json").write_text("{not json")
    invalid = write_checkpoint(tmp_path, 40, ok=False, val_loss=None)
    assert not invalid.valid
    with caplog.at_level(logging.WARNING):
        assert ckpts.find_resume(tmp_path).step == 10
    for expected in ("loss is nan", "no readable checkpoint.json", "0 bytes"):
        assert expected in caplog.text


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert ckpts.find_resume(tmp_path / "none") is None
    assert ckpts.find_resume(tmp_path) is None


def test_an_orphaned_group_commits_nothing(tmp_path):
    """Rank 0 asks right before the commit whether its driver still holds the run
    (TrainJob.orphaned): a reason raises Orphaned and the step is not committed."""
    reasons = [None, "its driver (pid 7 on this host) is gone"]
    writer = ck.CheckpointWriter(tmp_path, 0, 1, 5, 0, async_save=False,
                                 orphaned=lambda: reasons.pop(0))  # fmt: skip
    writer.submit(5, lambda s: ck.save_file({}, s / "model.pt"), {"step": 5}, None)
    with pytest.raises(ck.Orphaned, match="not committing step 10: its driver"):
        writer.submit(10, lambda s: ck.save_file({}, s / "model.pt"), {"step": 10}, None)
    assert [i.step for i in ckpts.committed(tmp_path)] == [5]


def test_validator_exception_marks_invalid(tmp_path):
    writer = ck.CheckpointWriter(tmp_path, 0, 1, 2, 1, async_save=False)

    def broken(staging: Path) -> ckpts.Validation:
        raise RuntimeError("size mismatch for tok_embeddings.weight")

    writer.submit(5, lambda s: ck.save_file({}, s / "model.pt"), {"step": 5}, broken)
    (info,) = writer.completed()
    assert not info.valid and "size mismatch" in info.meta["error"]


@pytest.mark.parametrize(
    ("losses", "keep_last", "keep_best", "expected"),
    [
        # keep_last newest valid + keep_best lowest val_loss
        ({10: 3.0, 20: 1.0, 30: 2.5, 40: 2.0, 50: 2.2}, 2, 1, {20, 40, 50}),
        ({10: 3.0, 20: 1.0, 30: 2.5, 40: 2.0, 50: 2.2}, 1, 0, {50}),
        ({10: 3.0, 20: 1.0, 30: 2.5, 40: 2.0, 50: 2.2}, 1, 2, {20, 40, 50}),
        ({10: 1.0, 20: 2.0}, 3, 1, {10, 20}),
    ],
)
def test_retention_keeps_last_and_best(tmp_path, losses, keep_last, keep_best, expected):
    for step, loss in losses.items():
        write_checkpoint(tmp_path, step, val_loss=loss)
    ckpts.prune(tmp_path, keep_last, keep_best)
    assert {i.step for i in ckpts.committed(tmp_path)} == expected


def test_a_kill_during_pruning_leaves_no_step_folder_without_its_commit(tmp_path, monkeypatch):
    """Seen in CI: an attempt killed while its writer pruned step 2 left step-00000002/
    without checkpoint.json, which nothing removed. The folder is renamed out of the
    step names before it is deleted, and the next start removes what is left."""
    for step in (2, 4):
        write_checkpoint(tmp_path, step)

    def killed(path, *args, **kwargs):  # the process dies inside the delete
        (Path(path) / ckpts.META_FILE).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpts.local.shutil, "rmtree", killed)  # what remove_checkpoint calls
    with pytest.raises(KeyboardInterrupt):
        ckpts.prune(tmp_path, keep_last=1, keep_best=0)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(ckpts.PREFIX)) == [
        "step-00000004"
    ]
    ckpts.clean_staging(tmp_path)  # the next attempt's start
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]


def test_retention_never_counts_or_drops_newer_invalid_ones(tmp_path):
    for step in (10, 20):
        write_checkpoint(tmp_path, step)
    write_checkpoint(tmp_path, 30, ok=False, val_loss=None)
    ckpts.prune(tmp_path, keep_last=1, keep_best=0)
    # 20 is the newest valid one; 30 (invalid, newer) stays for diagnosis
    assert [i.step for i in ckpts.committed(tmp_path)] == [20, 30]


def test_async_writer_runs_in_background_and_reports_commit(tmp_path):
    writer = ck.CheckpointWriter(tmp_path, 0, 1, 2, 1, async_save=True)
    started = []

    def slow_files(staging: Path) -> None:
        started.append(True)
        ck.save_file({"w": torch.ones(4)}, staging / "model.pt")

    writer.submit(7, slow_files, {"step": 7}, None)
    writer.wait()
    (info,) = writer.completed()
    assert info.step == 7 and info.valid and not info.meta["validated"]


def test_async_writer_surfaces_errors_on_wait(tmp_path):
    writer = ck.CheckpointWriter(tmp_path, 0, 1, 2, 1, async_save=True)

    def failing(staging: Path) -> None:
        raise ValueError("cannot pickle it")

    writer.submit(3, failing, {"step": 3}, None)
    with pytest.raises(RuntimeError, match="cannot pickle it"):
        writer.wait()


def test_a_write_the_disk_fails_is_a_storage_fault_without_its_partial_checkpoint(tmp_path):
    """An OSError behind a checkpoint write (disk full, I/O error) is a StorageFault
    naming the cause and the step (the run ends on it, never restarted in place),
    and its staging directory is removed at once, inline and in the background."""
    for async_save in (False, True):
        root = tmp_path / f"async-{async_save}"
        writer = ck.CheckpointWriter(root, 0, 1, 2, 1, async_save=async_save)

        def failing(staging: Path) -> None:
            (staging / "part.pt").write_bytes(b"x" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")

        with pytest.raises(ck.StorageFault) as caught:
            writer.submit(3, failing, {"step": 3}, None)
            writer.wait()
        assert str(caught.value) == "no space left on device while saving step 3"
        assert caught.value.step == 3 and caught.value.error.errno == errno.ENOSPC
        assert list(root.iterdir()) == []


class Payload:
    """Stands for any pickled object a checkpoint must never execute."""


def test_files_load_only_with_weights_only(tmp_path):
    torch.save({"obj": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported global"):
        ck.load_file(tmp_path / "evil.pt")
