"""Every rejection reason, from crafted bad files, with the manifest balancing:
docs_in == docs_out + sum(rejected) for every source, nothing lost unaccounted."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainlab.data.prep import REASONS, run_prep
from trainlab.data.prep.cleaning import clean_text, content_id, decode_utf8
from trainlab.data.prep.readers import read_records
from trainlab.data.prep.spec import CleaningSettings

GOOD = "A perfectly ordinary document with enough characters in it. "


def put(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


def jsonl(*records: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


@pytest.fixture
def bad_corpus(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    # text: one document per file
    put(raw / "txt/01-good.txt", GOOD + "one\nend")
    put(raw / "txt/02-empty.txt", b"")
    put(raw / "txt/03-blank.txt", " \n\t \r\n")
    put(raw / "txt/04-short.txt", "tiny")
    put(raw / "txt/05-long.txt", "x" * 500)
    put(raw / "txt/06-latin1.txt", "caf\u00e9 au lait, ".encode("latin-1") * 5)
    put(raw / "txt/07-copy.txt", GOOD + "one\nend")
    put(raw / "txt/08-crlf-copy.txt", GOOD + "one\r\nend")  # the same once cleaned
    # jsonl: one record per line
    put(
        raw / "recs/a.jsonl",
        jsonl(
            {"text": GOOD + "two"},
            "{not json",
            "[1, 2, 3]",
            {"other": "field"},
            {"text": None},
            {"text": 42},
            "",  # a blank line is not a record
            '{"text": "lone surrogate \\ud800 inside a document of some length"}',
        ),
    )
    with (raw / "recs/a.jsonl").open("ab") as f:
        f.write(b'{"text": "bad \xff\xfe utf-8 in this line"}\n')
    put(raw / "recs/b-empty.jsonl", b"")
    # parquet: a text column
    parquet(raw / "tab/1-good.parquet", pa.table({"text": [GOOD + "three", None, "short"]}))
    parquet(raw / "tab/2-nocol.parquet", pa.table({"body": ["a", "b"]}))
    parquet(raw / "tab/3-int.parquet", pa.table({"text": [1, 2]}))
    parquet(raw / "tab/4-zero.parquet", pa.table({"text": pa.array([], pa.string())}))
    parquet(
        raw / "tab/5-binary.parquet",
        pa.table(
            {
                "text": pa.array(
                    [(GOOD + "four").encode(), b"\xff\xfe\xfa bad bytes here"], pa.binary()
                )
            }
        ),
    )
    put(raw / "tab/6-corrupt.parquet", b"PAR1 this is not really parquet at all PAR1")
    (tmp_path / "sources.yaml").write_text("""
root: raw
train_tokenizer: {vocab_size: 300}
cleaning: {min_chars: 10, max_chars: 300}
sources:
  - {name: txt, paths: [txt/], format: text}
  - {name: recs, paths: ["recs/*.jsonl"], format: jsonl, text_field: text}
  - {name: tab, paths: [tab], format: parquet, text_field: text}
""")
    return tmp_path


def counts(source: dict) -> dict[str, int]:
    return {r: v["count"] for r, v in source["rejected"].items() if v["count"]}


def test_every_reason_is_counted_with_examples_and_the_manifest_balances(bad_corpus):
    m = run_prep(bad_corpus / "sources.yaml", bad_corpus / "out", executor="local").manifest
    src = m["sources"]
    assert counts(src["txt"]) == {
        "empty": 2,
        "too_short": 1,
        "too_long": 1,
        "bad_encoding": 1,
        "duplicate": 2,
    }
    assert counts(src["recs"]) == {
        "malformed_record": 3,
        "missing_field": 2,
        "bad_encoding": 2,
        "empty": 1,
    }
    assert counts(src["tab"]) == {
        "missing_field": 3,
        "malformed_record": 2,
        "too_short": 1,
        "empty": 1,
        "bad_encoding": 1,
        "unreadable": 1,
    }
    assert (src["txt"]["docs_out"], src["recs"]["docs_out"], src["tab"]["docs_out"]) == (1, 1, 2)
    for name, s in src.items():
        assert set(s["rejected"]) == set(REASONS)
        assert s["docs_in"] == s["docs_out"] + sum(r["count"] for r in s["rejected"].values()), name
        assert s["tokens"] == sum(sh["tokens"] for sh in s["shards"])
    # Examples say where: the file, the JSONL line (1-based), the Parquet row.
    recs = src["recs"]["rejected"]
    a = str(bad_corpus / "raw/recs/a.jsonl")
    assert recs["malformed_record"]["examples"] == [f"{a}:2", f"{a}:3", f"{a}:6"]
    assert recs["missing_field"]["examples"] == [f"{a}:4", f"{a}:5"]
    assert recs["empty"]["examples"] == [str(bad_corpus / "raw/recs/b-empty.jsonl")]
    tab = src["tab"]["rejected"]
    assert f"{bad_corpus / 'raw/tab/1-good.parquet'}:row=1" in tab["missing_field"]["examples"]
    assert tab["unreadable"]["examples"][0].startswith(str(bad_corpus / "raw/tab/6-corrupt"))
    assert src["txt"]["rejected"]["duplicate"]["examples"] == [
        str(bad_corpus / "raw/txt/07-copy.txt"),
        str(bad_corpus / "raw/txt/08-crlf-copy.txt"),
    ]


def test_examples_are_capped_at_five(tmp_path):
    put(tmp_path / "raw/a.jsonl", jsonl(*[{"x": i} for i in range(12)], {"text": GOOD}))
    (tmp_path / "s.yaml").write_text(
        "root: raw\ntrain_tokenizer: {vocab_size: 300}\n"
        "sources: [{name: a, paths: [a.jsonl], format: jsonl, "
        "text_field: text}]\n"
    )
    m = run_prep(tmp_path / "s.yaml", tmp_path / "out", executor="local").manifest
    missing = m["sources"]["a"]["rejected"]["missing_field"]
    assert missing["count"] == 12 and len(missing["examples"]) == 5


def test_a_file_that_cannot_be_read_is_one_unreadable_record(tmp_path):
    gone = str(tmp_path / "vanished.txt")
    for fmt in ("text", "jsonl", "parquet"):
        records = list(read_records(gone, fmt, "text" if fmt != "text" else None))
        assert [r.reason for r in records] == ["unreadable"]
        assert records[0].location.startswith(gone)


@pytest.mark.parametrize(
    "raw, cleaned",
    [
        ("a\r\nb\rc", "a\nb\nc"),
        ("cafe\u0301", "caf\u00e9"),  # NFD -> NFC
        ("tab\tnew\nline\x00\x07\x1b[0m\x7f\x85", "tab\tnew\nline[0m"),
        ("zero\u200bwidth stays", "zero\u200bwidth stays"),  # a format char, not a control
    ],
)
def test_cleaning_rules(raw, cleaned):
    assert clean_text(raw, CleaningSettings(min_chars=1)) == (cleaned, None)


@pytest.mark.parametrize(
    "raw, reason",
    [
        ("", "empty"),
        ("  \n\t\x00 ", "empty"),
        ("abc", "too_short"),
        ("x" * 21, "too_long"),
    ],
)
def test_cleaning_rejections(raw, reason):
    assert clean_text(raw, CleaningSettings(min_chars=5, max_chars=20)) == ("", reason)


def test_decoding_and_content_ids():
    assert decode_utf8("\ufeffhello".encode()) == "hello"
    assert decode_utf8(b"caf\xe9") is None
    settings = CleaningSettings()
    variants = ["caf\u00e9\r\nbar", "cafe\u0301\nbar", "caf\u00e9\nbar\x00"]
    ids = {content_id(clean_text(v, settings)[0]) for v in variants}
    assert len(ids) == 1
    assert content_id("\ud800") is None
