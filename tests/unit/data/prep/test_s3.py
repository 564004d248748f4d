"""Sources on S3 (s3:// globs and folders) are listed and read through pyarrow's
S3 filesystem, against a real S3-compatible server (moto's) on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from trainlab.data.prep import run_prep
from trainlab.errors import UserError

TEXT = "A document stored in a bucket, long enough to be kept by the cleaner. "


@pytest.fixture
def bucket(s3_env) -> str:
    """A bucket on the moto server (tests/conftest.py) holding a few sources."""
    s3, name = s3_env
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
