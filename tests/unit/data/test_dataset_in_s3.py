"""`data.path: s3://bucket/prefix` against a real S3-compatible server (moto's,
tests/conftest.py): the training stream reads the shards from the store and
delivers exactly the batches of the same dataset read from a local directory;
a changed dataset is caught (checksums, fingerprint on resume); `data inspect`
and `data at-step` take the URI; a location with nothing there, or of another
scheme, is one line naming data.path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from devtools.datasets import small_dataset
from tests.unit.data.test_stream import make_cfg
from trainlab.cli import main
from trainlab.data import WorkerLoader, prepare_run_data
from trainlab.data.at_step import rows_at_step
from trainlab.data.inspect import inspect_stream
from trainlab.data.loader import check_resume
from trainlab.data.manifest import ManifestDoc, doc_fingerprint
from trainlab.data.stream import TrainStream
from trainlab.errors import UserError

TINY = Path(__file__).resolve().parents[3] / "trainers" / "recipes" / "tiny.yaml"


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_dataset(tmp_path_factory.getbasetemp() / "small-ds")


def upload(s3, bucket: str, root: Path, prefix: str) -> str:
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        s3.put_object(
            Bucket=bucket, Key=f"{prefix}/{f.relative_to(root).as_posix()}", Body=f.read_bytes()
        )
    return f"s3://{bucket}/{prefix}"


def batches(spec, steps: int) -> list[np.ndarray]:
    loader = WorkerLoader(spec, 0, 1, backend="local")
    return [
        np.stack([m[k] for m in micro for k in sorted(m)])
        for _, micro in loader.iter_from(0, steps)
    ]


def test_the_stream_from_s3_is_the_stream_from_a_local_directory(s3_env, local):
    s3, bucket = s3_env
    uri = upload(s3, bucket, local, "ds")
    spec_local = prepare_run_data(make_cfg(local))
    spec_s3 = prepare_run_data(make_cfg(uri))  # manifest, every shard's sha256 and rows
    assert spec_s3.path == uri and spec_s3.fingerprint == spec_local.fingerprint
    got, want = batches(spec_s3, 12), batches(spec_local, 12)
    assert len(got) == 12 and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    # Validation rows come from the store too.
    for name in spec_s3.all_sources:
        a = TrainStream(spec_s3).validation_rows(name, 0, 4).batch["input_ids"]
        b = TrainStream(spec_local).validation_rows(name, 0, 4).batch["input_ids"]
        assert np.array_equal(a, b)
    # `data inspect` and `data at-step` read it the same way.
    cfg_s3, cfg_local = make_cfg(uri), make_cfg(local)
    r_s3, r_local = (inspect_stream(c, 5, backend="local") for c in (cfg_s3, cfg_local))
    assert r_s3["sources"] == r_local["sources"] and r_s3["tokens"] == r_local["tokens"]
    at_s3 = rows_at_step(cfg_s3, 4, rows=3, decode=True)
    assert at_s3 == rows_at_step(cfg_local, 4, rows=3, decode=True)
    assert at_s3["rows"][0]["text"]


def test_a_changed_dataset_in_the_store_is_caught(s3_env, local):
    s3, bucket = s3_env
    uri = upload(s3, bucket, local, "ds")
    spec = prepare_run_data(make_cfg(uri))
    state = WorkerLoader(spec, 0, 1, backend="local").state_dict(7)
    # A shard replaced behind the manifest's back: its checksum says so.
    shard = "code/part-00000.parquet"
    body = s3.get_object(Bucket=bucket, Key=f"ds/{shard}")["Body"].read()
    s3.put_object(Bucket=bucket, Key=f"ds/{shard}", Body=body[:-8] + b"\0" * 8)
    with pytest.raises(UserError, match=f"{uri}/{shard}: sha256 differs from the manifest"):
        prepare_run_data(make_cfg(uri))
    # The dataset re-prepared under the same location (here: the same files under
    # other cleaning settings, so a new fingerprint): resuming the run on it is refused.
    s3.put_object(Bucket=bucket, Key=f"ds/{shard}", Body=body)
    raw = json.loads(s3.get_object(Bucket=bucket, Key="ds/manifest.json")["Body"].read())
    raw["cleaning"] = {**raw["cleaning"], "reprepared": True}
    raw["fingerprint"] = doc_fingerprint(ManifestDoc.model_validate(raw))
    s3.put_object(Bucket=bucket, Key="ds/manifest.json", Body=json.dumps(raw).encode())
    respec = prepare_run_data(make_cfg(uri))
    new = raw["fingerprint"][:16]
    with pytest.raises(UserError, match=f"data.path = {uri}: prepared dataset fingerprint {new}"):
        check_resume(respec, state)
    # A worker whose spec predates the change refuses to read the new dataset.
    with pytest.raises(UserError, match="the prepared dataset changed under this run"):
        TrainStream(spec)


def test_nothing_at_the_location_is_one_line_naming_data_path(s3_env, capsys):
    _, bucket = s3_env
    with pytest.raises(SystemExit) as e:
        main(["data", "inspect", str(TINY), "--set", f"data.path=s3://{bucket}/none"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: data.path = 's3://{bucket}/none': no prepared dataset (no "
        f"s3://{bucket}/none/manifest.json); run `trainlab prep SOURCES --out "
        f"s3://{bucket}/none` first"
    ]


def test_another_scheme_is_refused_by_validate(capsys):
    with pytest.raises(SystemExit) as e:
        main(["validate", str(TINY), "--set", "data.path=hdfs://nn/ds"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(
        "data.path = 'hdfs://nn/ds': unsupported scheme 'hdfs'; give a local directory, "
        "s3://bucket/prefix or gs://bucket/prefix"
    )


def test_at_step_never_takes_a_uri_for_a_local_path(s3_env, tmp_path, monkeypatch, capsys):
    """A URI names a run in object storage (read from the store), never a local
    path: a URI with no run there is one line, and nothing is made in the cwd."""
    _, bucket = s3_env
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRAINLAB_SCRATCH_DIR", str(tmp_path.parent / f"{tmp_path.name}-scratch"))
    with pytest.raises(SystemExit) as e:
        main(["data", "at-step", f"s3://{bucket}/runs/tiny", "3"])
    assert e.value.code == 2 and list(tmp_path.iterdir()) == []
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"error: CONFIG_OR_RUN_DIR = 's3://{bucket}/runs/tiny': no such file, and no run "
        "there (no config.yaml)"
    )
