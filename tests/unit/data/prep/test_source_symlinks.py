"""A source folder is read, not what its symlinks point to outside it: a link to
a file outside the folder and a link to the folder's parent (`up -> ..`, a loop)
are skipped with one warning, and the walk ends (docs/security.md)."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.dataset as ds
from tokenizers import Tokenizer

from trainlab.data.prep import run_prep
from trainlab.data.prep.paths import list_source_files

INSIDE = "An ordinary document that belongs to the corpus, long enough to be kept. " * 3
OUTSIDE = "root:$6$Zq8salt$Secr3tHashValueXYZ:19000:0:99999:7::: the file outside the folder"


def linked_folder(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    (raw / "sub").mkdir(parents=True)
    (raw / "doc.txt").write_text(INSIDE)
    (raw / "sub" / "more.txt").write_text(INSIDE.replace("ordinary", "other"))
    secret = tmp_path / "elsewhere" / "shadow.txt"
    secret.parent.mkdir()
    secret.write_text(OUTSIDE)
    (raw / "shadow.txt").symlink_to(secret)  # a file outside the folder
    (raw / "up").symlink_to("..")  # the folder's parent: outside, and a loop
    (raw / "sub" / "again").symlink_to("..")  # inside the folder, but a loop
    (raw / "doc-link.txt").symlink_to("doc.txt")  # inside: read as the folder's own
    return raw


def test_listing_skips_symlinks_leading_out_of_the_folder(tmp_path, caplog):
    raw = linked_folder(tmp_path)
    with caplog.at_level(logging.WARNING, logger="trainlab.data.prep"):
        for entry in ("raw/", "raw/**/*.txt"):
            files = list_source_files([entry], tmp_path, "s")
            assert [Path(f.location).relative_to(raw).as_posix() for f in files] == [
                "doc-link.txt",
                "doc.txt",
                "sub/more.txt",
            ], entry
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one line per listing
    assert "skipped 2 symlinks" in warnings[0] and str(raw / "shadow.txt") in warnings[0]


def test_prep_of_a_folder_with_outside_links_holds_only_the_folder(tmp_path):
    linked_folder(tmp_path)
    sources = tmp_path / "s.yaml"
    sources.write_text(
        "root: .\ntrain_tokenizer: {vocab_size: 300}\n"
        'sources: [{name: s, paths: ["raw/"], format: text}]\n'
    )
    result = run_prep(sources, tmp_path / "out", executor="local")
    account = result.manifest["sources"]["s"]
    assert account["docs_in"] == 3  # doc.txt, its link (a duplicate), sub/more.txt
    out = tmp_path / "out"
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    table = ds.dataset(out / "s", format="parquet").to_table()
    texts = [tokenizer.decode(row["tokens"]) for row in table.to_pylist()]
    assert texts and not any("Secr3t" in t or "outside" in t for t in texts)
