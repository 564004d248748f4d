"""Shards are plain Parquet: pyarrow alone reads them, and decoding a document's
tokens with the stored tokenizer gives back its cleaned text."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from trainlab.data.prep import run_prep
from trainlab.data.prep.cleaning import clean_text, decode_utf8
from trainlab.data.prep.spec import CleaningSettings

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("readback")
    (tmp / "s.yaml").write_text(f"""
train_tokenizer: {{vocab_size: 600}}
shard_target_mb: 0.02
sources:
  - {{name: code, paths: ["{STDLIB}/json/*.py", "{STDLIB}/email/*.py"], format: text}}
""")
    result = run_prep(tmp / "s.yaml", tmp / "out", executor="local")
    return tmp / "out", result.manifest


def test_plain_pyarrow_reads_every_shard(prepared):
    out, manifest = prepared
    src = manifest["sources"]["code"]
    assert len(src["shards"]) > 1
    # The directory also holds manifest.json and tokenizer.json, so a whole-directory
    # read skips them; a source's folder holds only Parquet.
    table = ds.dataset(out, format="parquet", exclude_invalid_files=True).to_table()
    assert table.num_rows == src["docs_out"]
    assert ds.dataset(out / "code", format="parquet").count_rows() == src["docs_out"]
    assert table.schema.field("tokens").type == pa.list_(pa.uint16())
    assert table.schema.field("n_tokens").type == pa.int64()
    assert set(table.column("source").to_pylist()) == {"code"}
    for shard in src["shards"]:
        meta = pq.read_metadata(out / shard["file"])
        assert meta.num_rows == shard["rows"]
        assert meta.row_group(0).column(0).compression == "ZSTD"
        data = (out / shard["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]


def test_tokens_decode_back_to_the_cleaned_text(prepared):
    out, manifest = prepared
    tok_info = manifest["tokenizer"]
    tokenizer = Tokenizer.from_file(str(out / tok_info["file"]))
    assert hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest() == tok_info["sha256"]
    cleaned_by_id = {}
    for path in sorted((STDLIB / "json").glob("*.py")) + sorted((STDLIB / "email").glob("*.py")):
        text, reason = clean_text(decode_utf8(path.read_bytes()) or "", CleaningSettings())
        if reason is None:
            cleaned_by_id[hashlib.blake2b(text.encode(), digest_size=16).hexdigest()] = text
    table = ds.dataset(out / "code", format="parquet").to_table()
    assert table.num_rows == len(cleaned_by_id)
    for row in table.to_pylist():
        tokens = row["tokens"]
        assert len(tokens) == row["n_tokens"]
        assert tokens[-1] == tok_info["eos_id"] and tok_info["eos_id"] not in tokens[:-1]
        assert tokenizer.decode(tokens[:-1]) == cleaned_by_id[row["doc_id"]]
    assert int(np.sum(table.column("n_tokens").to_numpy())) == manifest["sources"]["code"]["tokens"]
