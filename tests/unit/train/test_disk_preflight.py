"""The disk preflight: a run refuses to start when its directory's filesystem
cannot hold keep_last + keep_best + 1 checkpoints of the planned size, with the
numbers, before anything is written (no Ray started)."""

from __future__ import annotations

import shutil

import pytest

from tests.train_helpers import dataset_dir, tiny_config
from trainlab.errors import UserError
from trainlab.nodedisk import check_disk_room, planned_checkpoint_bytes
from trainlab.plan import plan
from trainlab.train.driver.launcher import run

# A ~65B-parameter model: 780 GB per checkpoint. cpu_memory_gb lets the plan fit, so
# the disk is the only thing in the way.
HUGE = {
    "hidden_size": 8192,
    "num_layers": 80,
    "num_heads": 64,
    "num_kv_heads": 8,
    "ffn_hidden_size": 28672,
}


def test_a_run_whose_checkpoints_cannot_fit_is_refused_with_the_numbers(tmp_path_factory, tmp_path):
    cfg = tiny_config(
        dataset_dir(tmp_path_factory),
        model=HUGE,
        train={"runs_root": str(tmp_path / "runs"), "checkpoint": {"keep_last": 40}},
        resource={"cpu_memory_gb": 65536},
    )
    params = plan(cfg).num_params
    size = planned_checkpoint_bytes(params)
    assert 12 * params < size < 12 * params + 2**21

    with pytest.raises(UserError) as err:
        run(cfg, base_dir=tmp_path)
    message = str(err.value)
    assert f"the filesystem of {tmp_path / 'runs'}" in message and " GiB free; " in message
    assert "42 checkpoints (train.checkpoint.keep_last 40 + keep_best 1 + 1 being written)" in (
        message
    )
    assert f"of {size / 2**30:.2f} GiB each ({params:,} parameters x 12 bytes)" in message
    assert f"need {42 * size / 2**30:.2f} GiB more" in message
    assert not (tmp_path / "runs").exists()  # refused before the run directory was made


def test_checkpoints_already_in_the_run_directory_count_as_room_taken(tmp_path):
    class Keep:  # train.checkpoint
        keep_last, keep_best = 2, 1

    free = shutil.disk_usage(tmp_path).free
    params = free // 2 // 12  # a checkpoint of half the free space: four do not fit
    with pytest.raises(UserError, match=r"4 checkpoints .* need"):
        check_disk_room(tmp_path / "run", Keep, params)
    # A resumed run already holds 1.5 x free of checkpoints (a sparse file: no real
    # space): only the rest must still fit.
    held = tmp_path / "run" / "checkpoints" / "step-00000010"
    held.mkdir(parents=True)
    with open(held / "model.pt", "wb") as f:
        f.truncate(free + free // 2)
    check_disk_room(tmp_path / "run", Keep, params)


@pytest.mark.parametrize("root", ["s3://no-such-bucket/runs/r", "gs://no-such-bucket/runs/r"])
def test_a_run_in_object_storage_has_no_disk_to_fill(root):
    """No request: a store neither fills up nor is asked how full it is (there is
    no endpoint or credential in this test's environment)."""

    class Keep:
        keep_last, keep_best = 1000, 1000

    check_disk_room(root, Keep, 10**15)


def test_a_runs_root_that_takes_no_writes_is_refused_before_anything_is_made(
    tmp_path_factory, tmp_path
):
    """The runs root is probed where its writes would go, on a disk as in a store:
    one line naming it (a file on the way here, as a read-only mount would be)."""
    (tmp_path / "afile").write_text("")
    cfg = tiny_config(dataset_dir(tmp_path_factory), train={"runs_root": str(tmp_path / "afile/runs")})
    with pytest.raises(UserError, match=r"storage .*afile/runs is not writable: .*not a directory"):
        run(cfg, base_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
