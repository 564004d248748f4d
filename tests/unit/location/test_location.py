"""The location contract: every backend (this machine's disk, S3 through moto's
server, Google Cloud Storage through its emulator) does the same operations
with the same results, and says what went wrong by kind."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from trainlab.errors import UserError
from trainlab.location import (
    Absent,
    Corrupt,
    Location,
    StoreUnavailable,
    Unavailable,
    check,
    locate,
    read_retrying,
)


@pytest.fixture(params=["local", "s3", "gs"])
def place(request, tmp_path) -> Location:
    if request.param == "local":
        return locate(tmp_path / "place")
    if request.param == "s3":
        _, bucket = request.getfixturevalue("s3_env")
        return locate(f"s3://{bucket}/place")
    bucket = request.getfixturevalue("gcs_env")
    return locate(f"gs://{bucket}/place")


def test_files_round_trip_on_every_backend(place, tmp_path):
    assert place.read_or_none("a.json") is None and not place.exists("a.json")
    place.write_json("a.json", {"x": 1})
    assert place.read_json("a.json") == {"x": 1}
    place.write_text("a.json", '{"x": 2}')  # replaced whole
    assert place.read_json("a.json") == {"x": 2} and place.size("a.json") == 8
    place.write_bytes("sub/deeper/b.bin", b"\x00\x01")
    assert place.exists("sub") and place.exists("sub/deeper/b.bin")
    assert place.list() == ["a.json", "sub"] and place.list("nothing") == []
    assert place.walk() == [("a.json", 8), ("sub/deeper/b.bin", 2)]
    assert place.child("sub").walk() == [("deeper/b.bin", 2)]
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload" * 1000)
    import hashlib

    assert place.upload(src, "up/src.bin") == hashlib.sha256(src.read_bytes()).hexdigest()
    place.download("up/src.bin", tmp_path / "back" / "x.bin")
    assert (tmp_path / "back" / "x.bin").read_bytes() == src.read_bytes()
    with place.open_input_file("up/src.bin") as f:
        assert f.read(7) == b"payload"
    here = place.file_here("up/src.bin", tmp_path / "cache")  # a path to open here
    assert here.read_bytes() == src.read_bytes()
    assert (here == Path(place.fs_path("up/src.bin"))) == place.is_local  # in place on a disk
    place.delete("a.json")
    place.delete("a.json")  # twice: no error
    place.delete_tree("sub")
    assert place.list() == ["up"] and not place.exists("sub/deeper/b.bin")


def test_room_on_a_disk_and_none_to_fill_in_a_store(place, tmp_path):
    """A disk's free bytes are measured where the folder would be made; room held
    for a run's last records is a real file of that size there, freed by release.
    An object store has no disk to fill: unbounded, and nothing is written."""
    assert 0 < place.child("not/made/yet").free_bytes() == place.free_bytes()
    assert place.reserve("logs/.reserve", 4096)
    assert place.reserve("logs/.reserve", 4096)  # held already: kept
    assert (place.size("logs/.reserve") == 4096) == place.is_local
    assert place.exists("logs/.reserve") == place.is_local  # nothing put in a store
    place.release("logs/.reserve")
    place.release("logs/.reserve")  # twice: no error
    assert not place.exists("logs/.reserve")
    assert (place.free_bytes() == float("inf")) != place.is_local
    here = place.folder_here(tmp_path / "copies")  # this location as a folder here
    assert here == (place.local_path() if place.is_local else tmp_path / "copies" / place.path)


def test_a_file_copied_here_and_back(place, tmp_path):
    """A copy of one file in a local folder and back: a working copy of a store's
    file; on a disk, the file in place is its own copy (nothing written)."""
    folder = place.folder_here(tmp_path / "copies")
    assert not place.copy_to("logs/j.jsonl", folder / "logs/j.jsonl")  # absent
    place.write_text("logs/j.jsonl", "a\n")
    assert place.copy_to("logs/j.jsonl", folder / "logs/j.jsonl")
    assert (folder / "logs/j.jsonl").read_text() == "a\n"
    (folder / "logs/j.jsonl").write_text("a\nb\n")
    place.copy_from(folder / "logs/j.jsonl", "logs/j.jsonl")
    assert place.read_text("logs/j.jsonl") == "a\nb\n"
    place.copy_to("logs/j.jsonl", tmp_path / "elsewhere.jsonl")  # any local file
    assert (tmp_path / "elsewhere.jsonl").read_text() == "a\nb\n"


def test_files_to_read_below_a_folder_skip_hidden_names(place):
    for rel in ("a.txt", ".h.txt", "d/.git/x.txt", "d/b.txt", "d/e/c.txt"):
        place.write_text(rel, rel)
    found, links = place.files_below()
    base = place.path.rstrip("/") + "/"
    assert sorted(i.path.removeprefix(base) for i in found) == ["a.txt", "d/b.txt", "d/e/c.txt"]
    assert {i.size for i in found} == {5, 7, 9} and all(i.mtime_ns > 0 for i in found)
    assert links == []


def test_one_holder_of_a_lease_on_every_backend(place, monkeypatch):
    """The lease (trainlab.location.lease): a second taker is refused naming the
    holder, a released lease is free again, a gone holder's lease is taken over
    with the caller told whom it replaced, and a moment of holding still says who
    holds it. Its kind is the backend's: a flock on a disk, the record in a store."""
    import json
    import os

    from trainlab.location.lease import Held

    monkeypatch.setenv("TRAINLAB_LOCK_SETTLE_S", "0.05")  # GCS's emulator: no conditional writes
    lost = []
    with place.lease(lambda *a: lost.append(a)) as lease:
        assert lease.previous is None and lease.holder.pid == os.getpid()
        with pytest.raises(Held) as held:
            place.lease(lambda *a: None)
        assert held.value.holder.pid == os.getpid()
        with place.kept_still() as who:
            assert who is not None and who.startswith(f"pid {os.getpid()} on host ")
    assert place.read_or_none(".lock.json") is None  # released: the record goes
    with place.kept_still() as who:
        assert who is None
    gone = {"host": os.uname().nodename, "pid": 2**22 + 7, "since": 1.0, "beat": 1e12}
    place.write_text(".lock.json", json.dumps(gone))  # a holder that died holding it
    with place.lease(lambda *a: None) as lease:
        assert lease.previous is not None and lease.previous.pid == gone["pid"]
    assert lost == []


def test_what_is_known_without_a_request(place):
    """Config validation asks what a disk says at once; a store is never asked."""
    place.write_text("there.json", "{}")
    known = (True, False) if place.is_local else (None, None)
    assert (place.exists_offline("there.json"), place.exists_offline("gone.json")) == known


def test_a_full_disk_holds_no_room(tmp_path, monkeypatch):
    import os

    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(os, "fsync", full)
    place = locate(tmp_path / "run")
    assert not place.reserve("logs/.reserve", 4096) and not place.exists("logs/.reserve")


def test_where_a_location_lies_below_a_folder(tmp_path):
    (tmp_path / "repo" / "data").mkdir(parents=True)
    (tmp_path / "repo" / "link").symlink_to(tmp_path / "elsewhere")
    assert locate("data/x", base_dir=tmp_path / "repo").below(tmp_path / "repo") == "data/x"
    assert locate(tmp_path / "repo").below(tmp_path / "repo") == "."
    assert locate(tmp_path / "repo" / "link").below(tmp_path / "repo") is None  # resolved
    assert locate("s3://b/repo").below(tmp_path / "repo") is None


def test_appends_from_many_writers_are_all_kept_in_order(place):
    def writer(i: int) -> None:
        for j in range(5):
            place.append_jsonl("logs/events.jsonl", [{"w": i, "j": j}])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = place.read_jsonl("logs/events.jsonl")
    assert sorted((r["w"], r["j"]) for r in got) == [(i, j) for i in range(4) for j in range(5)]
    for i in range(4):  # each writer's own records in its order
        assert [r["j"] for r in got if r["w"] == i] == list(range(5))
    assert place.read_jsonl("logs/none.jsonl") == []


def test_errors_have_kinds(place):
    with pytest.raises(Absent) as absent:
        place.read_bytes("missing.json")
    assert isinstance(absent.value, FileNotFoundError) and "missing.json" in str(absent.value)
    place.write_text("bad.json", "{not json")
    with pytest.raises(Corrupt, match="bad.json"):
        place.read_json("bad.json")
    with pytest.raises(UserError, match="leads outside"):
        place.read_bytes("../escape")


def test_a_store_that_does_not_answer_is_unavailable_not_absent(monkeypatch):
    """A refused connection is never taken for a missing object; read_retrying
    gives up with StoreUnavailable (exit 74) after its retries."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("TRAINLAB_STORE_RETRY_S", "0.1")
    where = locate("s3://bucket/runs")
    with pytest.raises(Unavailable):
        where.read_bytes("checkpoint.json")
    with pytest.raises(StoreUnavailable) as e:
        read_retrying(lambda: where.read_bytes("checkpoint.json"), "checkpoint.json")
    assert e.value.exit_code == 74


def test_what_a_user_writes_becomes_one_location(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert locate("runs").uri == str(tmp_path / "runs")
    assert locate("file://" + str(tmp_path / "x")).uri == str(tmp_path / "x")
    assert locate("x", base_dir="/srv").uri == "/srv/x"
    assert locate("s3://b/p/").uri == "s3://b/p" and locate("s3a://b").uri == "s3://b"
    assert (
        locate("gs://b/p").uri == "gs://b/p" and locate("gs://b/p").child("q").uri == "gs://b/p/q"
    )
    assert locate("s3://b/p").parent.uri == "s3://b"
    for bad, msg in [
        ("hdfs://nn/x", "unsupported scheme 'hdfs'"),
        ("s3://user:secret@b/x", "credentials never go in a storage URL"),
        ("s3:///x", "no bucket"),
        ("", "empty"),
    ]:
        with pytest.raises(UserError, match=msg) as e:
            locate(bad, what="train.runs_root")
        assert "train.runs_root" in str(e.value) and "secret" not in str(e.value)
    check("gs://b/x", "data.path")  # no network needed
