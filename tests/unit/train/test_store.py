"""Runs in object storage (trainlab.run.location, trainlab.run.checkpoints.store),
against a real S3-compatible server (moto's, tests/conftest.py) on 127.0.0.1:
the per-rank checkpoint protocol and its commit marker, what a resume never
takes, retention, a store outage during a save, the run's records and its lock.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainlab.location.lease import Lease
from trainlab.nodedisk import UnsafePath
from trainlab.run import checkpoints as ckpts
from trainlab.run.checkpoints.store import CheckpointStore
from trainlab.run.location import RunLocation
from trainlab.run.lock import RunLock, RunLockHeld
from trainlab.run.records import Failure, RunRecords
from trainlab.train import checkpoint as ck


@pytest.fixture
def run(s3_env, tmp_path, monkeypatch) -> RunLocation:
    """A run's location in a fresh bucket, its working copy under tmp_path."""
    _, bucket = s3_env
    monkeypatch.setenv("TRAINLAB_SCRATCH_DIR", str(tmp_path / "scratch"))
    return RunLocation.of(f"s3://{bucket}/runs/2026-12-05/r", str(tmp_path / "scratch"))


def _writer(loc: RunLocation, rank: int = 0, world: int = 1, **kw) -> ck.CheckpointWriter:
    store = CheckpointStore(loc)
    return ck.CheckpointWriter(
        store.local_root,
        rank,
        world,
        kw.pop("keep_last", 2),
        kw.pop("keep_best", 0),
        async_save=False,
        catalog=store,
        **kw,
    )


def _files(rank: int, step: int):
    """What a rank writes for a checkpoint: a file of its own, and on rank 0 one in
    a subfolder (as DCP's state/)."""

    def write(staging: Path) -> None:
        (staging / f"rng-rank{rank}.pt").write_bytes(f"rank {rank} step {step}".encode() * 100)
        if rank == 0:
            (staging / "state").mkdir(exist_ok=True)
            (staging / "state" / ".metadata").write_bytes(b"index of step %d" % step)

    return write


def _save(loc: RunLocation, step: int, world: int = 1, validator=None, **kw) -> list:
    """Checkpoint `step` by every rank, rank 0 last (it waits for the others)."""
    done = []
    for rank in reversed(range(world)):
        w = _writer(loc, rank, world, **kw)
        w.submit(step, _files(rank, step), {"step": step, "world_size": world}, validator)
        done += w.completed()
    return done


def _keys(s3, bucket: str) -> set[str]:
    return {o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}


def test_every_rank_uploads_its_part_and_rank_0_commits_last(run, s3_env):
    s3, bucket = s3_env
    seen = []
    validator = lambda staging: (  # noqa: E731 - the whole checkpoint is there to check
        seen.append(sorted(p.name for p in staging.rglob("*") if p.is_file()))
        or ckpts.Validation(ok=True, loss=1.5)
    )
    (info,) = _save(run, 10, world=2, validator=validator)
    assert info.uri == f"{run.uri}/checkpoints/step-00000010" == info.where
    # Validation ran on a complete local copy: rank 1's part was read back from the store.
    assert seen == [[".metadata", "rng-rank0.pt", "rng-rank1.pt"]]
    meta = json.loads(
        s3.get_object(Bucket=bucket, Key=f"{_prefix(run)}/step-00000010/checkpoint.json")[
            "Body"
        ].read()
    )
    assert sorted(meta["files"]) == ["rng-rank0.pt", "rng-rank1.pt", "state/.metadata"]
    assert meta["valid"] is True and meta["validation_loss"] == 1.5
    # The done markers are gone once committed; nothing else is left behind.
    step_keys = {k for k in _keys(s3, bucket) if "/step-00000010/" in k and not k.endswith("/")}
    assert {k.rsplit("step-00000010/", 1)[1] for k in step_keys} == {
        "checkpoint.json", "rng-rank0.pt", "rng-rank1.pt", "state/.metadata"
    }  # fmt: skip
    # This node's cache holds the verified newest checkpoint; no staging is left.
    assert [p.name for p in CheckpointStore(run).local_root.iterdir()] == ["step-00000010"]


def _prefix(loc: RunLocation) -> str:
    return loc.key("checkpoints").split("/", 1)[1]


@pytest.mark.parametrize("damage", ["part_missing", "commit_missing", "part_corrupted"])
def test_a_partial_checkpoint_in_the_store_is_never_restored(run, s3_env, damage, tmp_path):
    s3, bucket = s3_env
    _save(run, 10, world=2)
    _save(run, 20, world=2)
    newest = f"{_prefix(run)}/step-00000020"
    if damage == "part_missing":
        s3.delete_object(Bucket=bucket, Key=f"{newest}/rng-rank1.pt")
    elif damage == "commit_missing":  # a save cut off before rank 0's commit
        s3.delete_object(Bucket=bucket, Key=f"{newest}/checkpoint.json")
    else:  # same size, other bytes: only the sha256 can tell
        body = s3.get_object(Bucket=bucket, Key=f"{newest}/rng-rank1.pt")["Body"].read()
        s3.put_object(Bucket=bucket, Key=f"{newest}/rng-rank1.pt", Body=body[::-1])
    fresh = RunLocation.of(run.uri, str(tmp_path / "another-node"))  # nothing cached
    store = CheckpointStore(fresh)
    got = store.fetch_newest()
    assert got is not None and got.step == 10
    assert (got.path / "rng-rank1.pt").read_bytes().startswith(b"rank 1 step 10")
    if damage != "part_corrupted":  # what a resume can tell without reading the bytes
        assert store.find_resume().step == 10
        assert [u.rsplit("/", 1)[1] for u, _ in store.refusals()] == ["step-00000020"]


def test_retention_and_cleanup_in_the_store(run, s3_env):
    s3, bucket = s3_env
    for step in (10, 20, 30, 40):
        _save(run, step, keep_last=2)
    store = CheckpointStore(run)
    assert [i.step for i in store.committed()] == [30, 40]
    # A save that never committed (its marker only) is removed at the next start.
    s3.put_object(Bucket=bucket, Key=f"{_prefix(run)}/step-00000050/.done-rank0", Body=b"{}")
    assert store.step_dirs() == [30, 40, 50]
    assert store.clean_uncommitted() == [50]
    assert store.step_dirs() == [30, 40]


def test_a_store_outage_fails_the_save_not_the_run(run, monkeypatch, caplog):
    _save(run, 10)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    dead = RunLocation.of(run.uri + "-x", str(run.local.parent / "dead"))
    with caplog.at_level(logging.WARNING, logger="trainlab.train.checkpoint"):
        assert _save(dead, 20) == []  # no exception: training goes on
    assert "checkpoint step 20 was not saved" in caplog.text
    assert not list(CheckpointStore(dead).local_root.glob(".tmp-*"))  # no staging left


def test_one_rank_failing_to_upload_gives_up_the_save_at_once(run, s3_env):
    store = CheckpointStore(run)
    store.mark_part_failed(10, 1, "OSError: the store went away")
    w = _writer(run, 0, 2)
    w.submit(10, _files(0, 10), {"step": 10, "world_size": 2}, None)  # does not wait 1 h
    assert w.completed() == [] and store.step_dirs() == []


def test_names_from_the_store_never_lead_outside(run, s3_env, tmp_path):
    s3, bucket = s3_env
    (info,) = _save(run, 10)
    meta = dict(info.meta, files={"../../evil.pt": {"bytes": 1, "sha256": "0"}})
    s3.put_object(
        Bucket=bucket, Key=f"{_prefix(run)}/step-00000010/checkpoint.json", Body=json.dumps(meta)
    )
    store = CheckpointStore(RunLocation.of(run.uri, str(tmp_path / "node2")))
    with pytest.raises(UnsafePath):
        store.fetch(store.info(10))
    assert not (tmp_path / "evil.pt").exists()


def test_records_of_processes_on_different_nodes_meet_in_the_store(run, tmp_path):
    a = RunRecords(run)
    b = RunRecords(RunLocation.of(run.uri, str(tmp_path / "node2")))  # another node
    a.attempt_started("s1", 0, 2)
    b.add_failures(Failure("s1", "e1", 1, 5, "killed", "killed"))
    a.add_failures(Failure("s1", "e1", 0, 5, "peer", "peer"))
    assert [f["rank"] for f in b.failures("s1")] == [1, 0]
    assert a.restarts() == 0 and len(b.attempts()) == 1
    assert not b.interrupt_requested()
    a.request_interrupt()
    assert b.interrupt_requested()
    b.clear_interrupt()
    assert not a.interrupt_requested()
    assert a.write_summary({"status": "completed"}) == f"{run.uri}/run_summary.json"
    assert b.read_summary() == {"status": "completed"}
    assert not (run.local / "run_summary.json").exists()  # nothing of it on a local disk


def test_one_writer_per_run_in_the_store(run, monkeypatch):
    monkeypatch.setenv("TRAINLAB_LOCK_SETTLE_S", "0.05")
    with RunLock.acquire(run), pytest.raises(RunLockHeld, match=f"pid {os.getpid()}"):
        RunLock.acquire(run)
    with RunLock.acquire(run):  # released: free again
        pass
    # A holder that died without releasing (its pid is gone) is taken over.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    record = {"host": os.uname().nodename, "pid": int(dead), "since": 1.0, "beat": 1e12}
    run.write_text(".lock.json", json.dumps(record))
    with RunLock.acquire(run):
        assert run.read_jsonl("logs/lock.jsonl")[-1]["took_over_from"]["pid"] == int(dead)


def test_a_slow_lease_write_never_admits_two_drivers(run, monkeypatch):
    """Issue 38 item 7: driver A's write of the lease is slow (here: issued 1 s after
    its read, as a delayed PUT lands); driver B takes the lease meanwhile. A's write
    is conditional on the lease being absent, so it is refused, whatever the delay."""
    import threading
    import time

    from trainlab.location.core import Location
    assert run.home.conditional_writes  # S3 (moto): If-None-Match / If-Match
    real = Location.write_if
    slow = threading.current_thread().name

    def write_if(self, rel, data, version):
        if threading.current_thread().name == slow:
            time.sleep(1.0)
        return real(self, rel, data, version)

    monkeypatch.setattr(Location, "write_if", write_if)
    taken: list[Lease] = []
    other = threading.Thread(target=lambda: (time.sleep(0.2), taken.append(RunLock.acquire(run))))
    other.start()
    with pytest.raises(RunLockHeld, match="in use by another trainlab process"):
        RunLock.acquire(run)
    other.join()
    [b] = taken
    assert json.loads(run.read_text(".lock.json"))["since"] == b.holder.since
    b.release()
    assert run.read_text(".lock.json") is None


def test_a_driver_whose_lease_was_taken_over_stops_at_its_next_beat(run):
    """A driver cut off from the store long enough for its lease to go stale, taken
    over by another: its next beat is conditional on its own last version, finds
    the other holder and ends this driver (on_lost; by default exit 75) instead of
    training on beside the new one. Its release leaves the other's lease alone."""
    lost: list[tuple[str, object]] = []
    a = RunLock.acquire(run, on_lost=lambda uri, holder: lost.append((uri, holder)))
    assert a.beat() and not lost  # renewing its own lease
    theirs = {"host": "node-b", "pid": 4242, "since": 2.0, "beat": 2.0}
    run.write_text(".lock.json", json.dumps(theirs))  # B took it while A was cut off
    assert a.beat() is False
    [(uri, holder)] = lost
    assert uri == run.uri and (holder.host, holder.pid) == ("node-b", 4242)
    a.release()
    assert json.loads(run.read_text(".lock.json")) == theirs


def test_a_beat_that_landed_while_its_answer_was_lost_keeps_the_lease(run):
    """An outage can lose the answer to a beat whose write landed: the next beat's
    If-Match then fails on the driver's own newer record, which is no takeover."""
    lost: list[object] = []
    a = RunLock.acquire(run, on_lost=lambda uri, holder: lost.append(holder))
    landed = {**json.loads(run.read_text(".lock.json")), "beat": 123.0}
    run.write_text(".lock.json", json.dumps(landed))  # written, its ETag never seen
    assert a.beat() is True and lost == []
    assert a.beat() is True  # and the lease goes on from the version it read back
    assert json.loads(run.read_text(".lock.json"))["since"] == a.holder.since
    a.release()


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_gc_in_the_store_keeps_records_and_two_checkpoints_and_never_a_live_run(
    scheme, request, tmp_path, monkeypatch
):
    """`trainlab gc` is one implementation for a disk and every store
    (trainlab.cli.gc_cmd); here on S3 and GCS."""
    from click.testing import CliRunner

    from trainlab.cli import cli

    monkeypatch.setenv("TRAINLAB_LOCK_SETTLE_S", "0.05")
    if scheme == "s3":
        _, bucket = request.getfixturevalue("s3_env")
    else:
        bucket = request.getfixturevalue("gcs_env")
    root = f"{scheme}://{bucket}/runs"
    old, live = (RunLocation.of(f"{root}/2026-12-01/{n}") for n in ("old", "live"))
    for loc in (old, live):
        loc.write_text("config.yaml", "name: x\n")
        RunRecords(loc).write_summary({"status": "completed"})
        RunRecords(loc).attempt_started("s", 0, 1)
    for step, loss in ((10, 2.0), (20, 1.0), (30, 3.0)):  # best 20, last valid 30
        validator = lambda _, loss=loss: ckpts.Validation(ok=True, loss=loss)  # noqa: E731
        _save(old, step, validator=validator, keep_last=5)
    _save(live, 10, keep_last=5)
    args = ["gc", "--runs-root", root, "--older-than", "0d", "--json"]
    with RunLock.acquire(live):
        result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    (trimmed,) = out["runs"]
    assert trimmed["run_dir"] == old.uri and trimmed["action"] == "trim"
    assert trimmed["kept_checkpoints"] == {"step-00000020": "best", "step-00000030": "last valid"}
    assert [s["run"] for s in out["skipped"]] == [live.uri]
    store = CheckpointStore(old)
    assert [i.step for i in store.committed()] == [20, 30] and store.step_dirs() == [20, 30]
    assert old.exists("config.yaml") and RunRecords(old).attempts()  # the records stay
    assert [i.step for i in CheckpointStore(live).committed()] == [10]
    forced = CliRunner().invoke(cli, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert old.is_empty() and live.is_empty()


def test_a_run_stopped_from_outside_gets_its_summary_in_the_store(run, s3_env):
    """`trainlab stop JOB` (and the correction of a lost run) write the summary the
    run's killed processes could not: for a run in object storage, into the store,
    naming its newest checkpoint by URI; once ended, it is not ended again."""
    from trainlab.config import load_config, to_yaml
    from trainlab.track.ended import write_ended_summary

    s3, bucket = s3_env
    repo = Path(__file__).resolve().parents[3]
    cfg = load_config(str(repo / "trainers/recipes/tiny.yaml"))
    run.write_text("config.yaml", to_yaml(cfg))
    records = RunRecords(run)
    records.attempt_started("s1", 0, 1)
    records.write_progress(6)
    ok = lambda staging: ckpts.Validation(ok=True, loss=2.5)  # noqa: E731
    _save(run, 4, validator=ok)

    summary = write_ended_summary(run.uri, "stopped", "stopped by trainlab stop job-1")
    assert summary["status"] == "stopped" and summary["final_step"] == 6
    assert summary["run_dir"] == run.uri
    assert summary["last_checkpoint"] == f"{run.uri}/checkpoints/step-00000004"
    assert summary["val_loss"] == 2.5
    stored = s3.get_object(Bucket=bucket, Key="runs/2026-12-05/r/run_summary.json")
    assert json.loads(stored["Body"].read()) == summary
    assert write_ended_summary(run.uri, "stopped", "again") is None


def test_a_throttled_store_never_costs_a_committed_checkpoint(run, s3_env, s3_server, monkeypatch,
                                                              tmp_path):
    """The store answers 503 SlowDown to every GET of checkpoint.json (through a
    fault proxy in front of the S3 server): the start-of-attempt cleanup and the
    driver's resume check retry, then stop with exit 74 naming the store, and
    every committed checkpoint is still there; once the store answers, the resume
    takes the newest. (It used to read a throttled checkpoint.json as "not
    committed" and delete every checkpoint.)"""
    from tests.faultproxy import FaultProxy
    from trainlab.exitcodes import STORAGE_FAULT
    from trainlab.location import StoreUnavailable

    s3, bucket = s3_env
    _save(run, 10)
    _save(run, 20)
    before = _keys(s3, bucket)
    monkeypatch.setenv("TRAINLAB_STORE_RETRY_S", "0.5")
    with FaultProxy(s3_server) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        throttled = CheckpointStore(RunLocation.of(run.uri, str(tmp_path / "node")))
        proxy.fail("GET", "/checkpoint.json")
        with pytest.raises(StoreUnavailable) as err:
            throttled.clean_uncommitted()
        assert err.value.exit_code == STORAGE_FAULT
        assert "checkpoint.json" in str(err.value) and "nothing was changed" in str(err.value)
        with pytest.raises(StoreUnavailable):
            throttled.find_resume()
        assert proxy.faults >= 2
        assert _keys(s3, bucket) == before  # nothing deleted
        proxy.clear()
        assert throttled.clean_uncommitted() == []
        assert throttled.find_resume().step == 20


def test_an_unreadable_commit_is_refused_and_kept_never_deleted(run, s3_env):
    """A checkpoint.json that does not parse is corrupt: the resume skips it (and
    says why), the cleanup keeps its folder."""
    s3, bucket = s3_env
    _save(run, 10)
    _save(run, 20)
    key = f"{_prefix(run)}/step-00000020/checkpoint.json"
    s3.put_object(Bucket=bucket, Key=key, Body=b'{"step": 20, "fil')
    store = CheckpointStore(run)
    assert store.clean_uncommitted() == []
    assert store.step_dirs() == [10, 20]
    assert store.find_resume().step == 10
    (uri, why), = store.refusals()
    assert uri.endswith("step-00000020") and "unreadable" in why and "kept" in why


def test_a_commit_whose_names_nest_is_refused_and_the_older_one_taken(run, s3_env, tmp_path):
    """A checkpoint.json listing `zz` and `zz/b` (both objects exist: a store allows
    it, no disk does) is refused as corrupt before anything is fetched, and the
    resume takes the next older checkpoint. (It used to pass the check and fail
    the fetch with FileExistsError, attempt after attempt.)"""
    s3, bucket = s3_env
    _save(run, 10)
    _save(run, 20)
    base = f"{_prefix(run)}/step-00000020"
    for name in ("zz", "zz/b"):
        s3.put_object(Bucket=bucket, Key=f"{base}/{name}", Body=b"x")
    meta = json.loads(s3.get_object(Bucket=bucket, Key=f"{base}/checkpoint.json")["Body"].read())
    meta["files"].update({"zz": {"bytes": 1, "sha256": "?"}, "zz/b": {"bytes": 1, "sha256": "?"}})
    s3.put_object(Bucket=bucket, Key=f"{base}/checkpoint.json", Body=json.dumps(meta).encode())
    store = CheckpointStore(RunLocation.of(run.uri, str(tmp_path / "fresh-node")))
    assert store.find_resume().step == 10
    (uri, why), = store.refusals()
    assert uri.endswith("step-00000020") and "'zz' and 'zz/b' nest" in why
    assert store.fetch_newest().step == 10


def test_an_outage_during_training_costs_no_step_and_no_record(run, s3_env, s3_server,
                                                                monkeypatch, tmp_path, caplog):
    """The store answers 503 to everything: the per-step records of rank 0's agent
    (progress, the driver's interrupt flag) are warned about once and training goes
    on; the run summary is retried until the store is back (here after ~1 s), and a
    store that stays down fails the write as a storage fault (an OSError), after
    the retries. (An outage of seconds used to end the run at the next step.)"""
    import threading

    from tests.faultproxy import FaultProxy
    from trainlab.location import Unavailable

    s3, bucket = s3_env
    monkeypatch.setenv("TRAINLAB_STORE_RETRY_S", "8")
    with FaultProxy(s3_server) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        records = RunRecords(RunLocation.of(run.uri, str(tmp_path / "node")))
        for method in ("GET", "PUT", "HEAD", "POST", "DELETE"):
            proxy.fail(method, "")
        with caplog.at_level(logging.WARNING, logger="trainlab.run.records"):
            for step in (1, 2, 3):
                records.write_progress(step)  # never raises
                assert records.interrupt_requested() is False
        warned = [r for r in caplog.records if "training goes on" in r.getMessage()]
        assert len(warned) == 1 and proxy.faults >= 1
        faults = proxy.faults  # after one failure the per-step records wait (backoff)
        records.write_progress(4)
        assert proxy.faults == faults
        threading.Timer(1.0, proxy.clear).start()  # the store comes back
        where = records.write_summary({"status": "completed", "final_step": 3})
        assert where.endswith("/run_summary.json")
        records._quiet_until = 0.0  # the backoff over
        records.write_progress(5)
        assert records.last_logged_step() == 5
        for method in ("GET", "PUT", "HEAD"):
            proxy.fail(method, "")
        monkeypatch.setattr("trainlab.location.errors.RETRY_DELAYS", (0.1,))
        monkeypatch.setenv("TRAINLAB_STORE_RETRY_S", "0.1")
        with pytest.raises(Unavailable, match="unavailable through 2 tries"):
            records.write_summary({"status": "failed"})
    key = f"{run.key('run_summary.json').split('/', 1)[1]}"
    body = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert body == {"status": "completed", "final_step": 3}  # the later write never landed


def test_a_run_in_gcs_checkpoints_resumes_and_records_as_in_s3(gcs_env, tmp_path, monkeypatch):
    """gs:// through the same code (the Google Cloud Storage emulator): the
    per-rank save and commit, retention, a resume on a node with nothing cached,
    the records of two nodes, the lock. (The multi-node cluster test of gs://,
    tests/e2e/test_store_cluster.py, is `extended`: it repeats the s3 one.)"""
    monkeypatch.setenv("TRAINLAB_SCRATCH_DIR", str(tmp_path / "scratch"))
    monkeypatch.setenv("TRAINLAB_LOCK_SETTLE_S", "0.05")
    run = RunLocation.of(f"gs://{gcs_env}/runs/r", str(tmp_path / "scratch"))
    for step in (10, 20, 30):
        (info,) = _save(run, step, world=2, keep_last=2)
        assert info.uri == f"{run.uri}/checkpoints/step-{step:08d}"
    store = CheckpointStore(run)
    assert [i.step for i in store.committed()] == [20, 30]
    run.write_text("checkpoints/step-00000040/.done-rank0", "{}")  # never committed
    assert store.clean_uncommitted() == [40]
    got = CheckpointStore(RunLocation.of(run.uri, str(tmp_path / "node2"))).fetch_newest()
    assert got is not None and got.step == 30
    assert (got.path / "rng-rank1.pt").read_bytes().startswith(b"rank 1 step 30")
    a, b = RunRecords(run), RunRecords(RunLocation.of(run.uri, str(tmp_path / "node3")))
    a.attempt_started("s1", 0, 2)
    b.add_failures(Failure("s1", "e1", 1, 5, "killed", "killed"))
    assert len(b.attempts()) == 1 and [f["rank"] for f in a.failures("s1")] == [1]
    assert a.write_summary({"status": "completed"}) == f"{run.uri}/run_summary.json"
    assert b.read_summary() == {"status": "completed"}
    with RunLock.acquire(run), pytest.raises(RunLockHeld):
        RunLock.acquire(run)


def test_an_abandoned_lease_and_log_shipper_send_nothing_more(run):
    """A Ctrl-C in a store outage: the driver ends at once instead of waiting on
    the SDK's retries of every unanswered request. Abandoned, the lease's release
    and the log shipper's exit make no request; the lease record stays, to go stale."""
    import time

    from trainlab.location.core import Backend
    from trainlab.run.location import LogShipper
    lock = RunLock.acquire(run)
    (run.local / "logs").mkdir(parents=True, exist_ok=True)
    (run.local / "logs" / "driver.log").write_text("a line\n")
    shipper = LogShipper(run).__enter__()
    calls: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("read", "write_atomic", "read_versioned", "write_if", "exists", "list",
                     "delete_file", "delete_tree", "upload"):  # fmt: skip
            real = getattr(Backend, name)
            mp.setattr(Backend, name, lambda self, *a, _n=name, _r=real, **k: (
                calls.append(_n), _r(self, *a, **k))[1])  # fmt: skip
        t0 = time.monotonic()
        for user in (lock, shipper):
            user.abandon()
        shipper.__exit__(None, None, None)
        lock.release()
        assert calls == [] and time.monotonic() - t0 < 1.0
    assert json.loads(run.read_text(".lock.json"))["pid"] == os.getpid()  # left to go stale
    assert run.read_text("logs/driver.log") is None  # not shipped
