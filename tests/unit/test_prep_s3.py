"""Sources on S3 (s3:// globs and folders) are listed and read through pyarrow's
S3 filesystem, against a real S3-compatible server (moto's) on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from trainlab.data.prep import run_prep
from trainlab.errors import UserError

TEXT = "A document stored in a bucket, long enough to be kept by the cleaner. "


@pytest.fixture(scope="module")
def s3_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def bucket(s3_url, monkeypatch) -> str:
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_url)
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=s3_url)
    name = f"corpus-{time.monotonic_ns()}"
    s3.create_bucket(Bucket=name)
    objects = {
        "raw/b.txt": TEXT + "b",
        "raw/a.txt": TEXT + "a",
        "raw/notes.md": "not matched by the glob",
        "recs/part1.jsonl": json.dumps({"text": TEXT + "a"}) + "\n{broken\n",
    }
    for key, body in objects.items():
        s3.put_object(Bucket=name, Key=key, Body=body.encode())
    return name


def test_prep_reads_s3_globs_and_folders(bucket, tmp_path):
    (tmp_path / "s.yaml").write_text(f"""
train_tokenizer: {{vocab_size: 300}}
sources:
  - {{name: txt, paths: ["s3://{bucket}/raw/*.txt"], format: text}}
  - {{name: recs, paths: ["s3://{bucket}/recs/"], format: jsonl, text_field: text}}
""")
    m = run_prep(tmp_path / "s.yaml", tmp_path / "out", executor="local").manifest
    assert m["sources"]["txt"]["docs_out"] == 2
    recs = m["sources"]["recs"]
    assert recs["rejected"]["duplicate"]["examples"] == [f"s3://{bucket}/recs/part1.jsonl:1"]
    assert recs["rejected"]["malformed_record"]["examples"] == [f"s3://{bucket}/recs/part1.jsonl:2"]


@pytest.mark.parametrize("entry", ["raw/*.json", "nothing-here/"])
def test_s3_paths_that_match_nothing_are_user_errors(bucket, tmp_path, entry):
    (tmp_path / "s.yaml").write_text(f"""
train_tokenizer: {{vocab_size: 300}}
sources: [{{name: txt, paths: ["s3://{bucket}/{entry}"], format: text}}]
""")
    with pytest.raises(UserError, match="source 'txt'"):
        run_prep(tmp_path / "s.yaml", tmp_path / "out", executor="local")
