"""`trainlab prep SOURCES --out s3://bucket/prefix` against a real S3-compatible
server (moto's, tests/conftest.py): the dataset lands in the bucket with its
manifest last, nothing named `s3:` appears locally, an upload cut off midway
leaves no manifest (and the next run finishes it), and other schemes are refused
in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import trainlab.data.prep.pipeline as pipeline
from tests.unit.data.prep.test_idempotence import make_corpus
from trainlab.cli import main
from trainlab.data.prep import run_prep
from trainlab.errors import UserError
from trainlab.location import locate


def keys(s3, bucket: str, prefix: str) -> set[str]:
    """The objects below `prefix`, but for empty directory markers (pyarrow's S3
    filesystem leaves one for the parent of a file it deletes: the write probe)."""
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"].removeprefix(prefix) for o in listed if not o["Key"].endswith("/")}


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """This test's own scratch area (the staging directory lives there)."""
    monkeypatch.setenv("TRAINLAB_SCRATCH_DIR", str(tmp_path / "scratch"))
    return tmp_path / "scratch"


def test_prep_to_s3_writes_the_dataset_and_nothing_local(s3_env, tmp_path, scratch, monkeypatch):
    s3, bucket = s3_env
    sources = make_corpus(tmp_path)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    result = run_prep(sources, f"s3://{bucket}/prepared", executor="local")
    assert result.out_dir == f"s3://{bucket}/prepared" and not result.up_to_date
    assert list(work.iterdir()) == []  # no folder named "s3:" (or anything else) here
    m = result.manifest
    shards = [s["file"] for s in m["sources"]["code"]["shards"]]
    assert len(shards) >= 2
    assert keys(s3, bucket, "prepared/") == {"manifest.json", "tokenizer.json", *shards}
    stored = json.loads(s3.get_object(Bucket=bucket, Key="prepared/manifest.json")["Body"].read())
    assert stored == m
    # The shards are plain Parquet, readable from the store with the manifest's rows.
    where = locate(f"s3://{bucket}/prepared")
    rows = [pq.read_table(where.fs_path(f), filesystem=where.filesystem).num_rows for f in shards]
    assert rows == [s["rows"] for s in m["sources"]["code"]["shards"]]
    assert not any(scratch.rglob("*.parquet"))  # the staging copy is gone once uploaded
    # The same inputs again: up to date, from the store's manifest.
    again = run_prep(sources, f"s3://{bucket}/prepared", executor="local")
    assert again.up_to_date and again.manifest == m
    # The same dataset as a local prep of the same inputs, byte for byte.
    local = run_prep(sources, tmp_path / "local", executor="local")
    assert local.manifest["fingerprint"] == m["fingerprint"]


def test_an_upload_cut_off_midway_leaves_no_manifest(s3_env, tmp_path, scratch, monkeypatch):
    s3, bucket = s3_env
    sources = make_corpus(tmp_path)
    uri = f"s3://{bucket}/ds"
    first = run_prep(sources, uri, executor="local")
    (tmp_path / "raw" / "extra.py").write_text("x = 1  # a new input file, long enough\n" * 4)

    real, uploaded = pipeline._upload_file, []

    def dies_after_two(local, store, rel):
        if len(uploaded) == 2:
            raise KeyboardInterrupt  # the process killed mid-upload (Ctrl-C)
        real(local, store, rel)
        uploaded.append(rel)

    monkeypatch.setattr(pipeline, "_upload_file", dies_after_two)
    monkeypatch.setattr(pipeline, "UPLOAD_THREADS", 1)
    with pytest.raises(KeyboardInterrupt):
        run_prep(sources, uri, executor="local")
    assert len(uploaded) == 2
    assert "manifest.json" not in keys(s3, bucket, "ds/")  # the old one went first

    monkeypatch.setattr(pipeline, "_upload_file", real)
    done = run_prep(sources, uri, executor="local")
    assert done.units_reused == done.units_total  # the staged units were kept
    assert done.manifest["fingerprint"] != first.manifest["fingerprint"]
    listed = {s["file"] for s in done.manifest["sources"]["code"]["shards"]}
    assert keys(s3, bucket, "ds/") == {"manifest.json", "tokenizer.json", *listed}


def test_a_missing_bucket_is_one_line_saying_how_to_create_it(
    s3_env, gcs_env, tmp_path, scratch, monkeypatch, capsys
):
    """Before any work; it said NO_SUCH_BUCKET inside a probe's multipart-upload
    error (S3) or "not there" (GCS), and the docs never said to create the bucket."""
    sources = make_corpus(tmp_path)
    monkeypatch.chdir(tmp_path)
    for uri, create in (
        ("s3://no-such-bucket-here/ds", "aws s3 mb s3://no-such-bucket-here"),
        ("gs://no-such-bucket-here/ds", "gcloud storage buckets create gs://no-such-bucket-here"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["prep", str(sources), "--out", uri])
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2
        assert line.startswith(f"error: --out {uri}: bucket 'no-such-bucket-here' does not exist (")
        assert f"create it first (e.g. `{create}`" in line and "docs/storage.md" in line
    # Another failure to write is still said as it is (nothing answers there).
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with pytest.raises(UserError) as err:
        run_prep(sources, "s3://no-such-bucket-here/ds", executor="local")
    assert "not writable" in err.value.lines[0] and "does not exist" not in err.value.lines[0]


@pytest.mark.parametrize("out", ["hdfs://namenode/ds", "ftp://host/ds"])
def test_an_unsupported_scheme_is_refused_in_one_line(tmp_path, monkeypatch, capsys, out):
    sources = make_corpus(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir(tmp_path))
    with pytest.raises(SystemExit) as e:
        main(["prep", str(sources), "--out", out])
    assert e.value.code == 2
    scheme = out.split(":")[0]
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --out = '{out}': unsupported scheme '{scheme}'; give a filesystem path, "
        "s3://bucket/prefix or gs://bucket/prefix"
    ]
    assert set(os.listdir(tmp_path)) == before


def test_prep_to_gcs_is_the_same_dataset_and_reads_back(gcs_env, tmp_path, scratch, monkeypatch):
    """gs:// takes a dataset as s3:// does (trainlab.location): manifest last, the
    same fingerprint as a local prep of the same inputs, and `load_manifest` with
    every shard verified by checksum from the store."""
    from trainlab.data.manifest import load_manifest, resolve_dataset_dir, verify_shards

    sources = make_corpus(tmp_path)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    uri = f"gs://{gcs_env}/prepared"
    result = run_prep(sources, uri, executor="local")
    assert result.out_dir == uri and not result.up_to_date and list(work.iterdir()) == []
    where = locate(uri)
    shards = [s["file"] for s in result.manifest["sources"]["code"]["shards"]]
    assert {rel for rel, _ in where.walk()} == {"manifest.json", "tokenizer.json", *shards}
    assert where.read_json("manifest.json") == result.manifest
    manifest = load_manifest(resolve_dataset_dir(uri))
    verify_shards(manifest, checksums=True)
    assert run_prep(sources, uri, executor="local").up_to_date
    local = run_prep(sources, tmp_path / "local", executor="local")
    assert local.manifest["fingerprint"] == result.manifest["fingerprint"]
