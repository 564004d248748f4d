"""`prep --out` writes only into an empty folder or a trainlab dataset: a folder
of the user's (their notes, their own tokenizer.json) is refused in one line,
exit 2, and left byte for byte as it was (docs/security.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainlab.cli import main
from trainlab.data.prep import run_prep
from trainlab.errors import UserError

TEXT = "some text here, long enough to train a small tokenizer on. " * 20


def corpus(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.txt").write_text(TEXT)
    (raw / "b.txt").write_text(TEXT.replace("small", "tiny"))
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        "train_tokenizer: {vocab_size: 300}\n"
        "sources: [{name: a, paths: [raw/], format: text}]\n"
    )
    return sources


def users_folder(tmp_path: Path, manifest: dict | None = None) -> Path:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes\n")
    (folder / "tokenizer.json").write_text('{"my": "own tokenizer"}\n')
    if manifest is not None:
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def state(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


@pytest.mark.parametrize("manifest", [None, {"name": "my-web-app", "version": 3}])
def test_out_into_a_folder_that_is_not_a_dataset_is_refused_untouched(tmp_path, manifest):
    sources = corpus(tmp_path)
    folder = users_folder(tmp_path, manifest)
    before = state(folder)
    with pytest.raises(UserError) as e:
        run_prep(sources, folder, executor="local")
    assert e.value.exit_code == 2
    assert e.value.lines == [
        f"--out {folder}: exists, is not empty and is not a trainlab dataset (no "
        "manifest.json of one); choose an empty or new directory"
    ]
    assert state(folder) == before


def test_the_cli_refuses_it_in_one_line(tmp_path, capsys, monkeypatch):
    def no_work(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - never Ray Data here
        raise AssertionError("prep went on to work in a folder it must refuse")

    monkeypatch.setattr("trainlab.data.prep.pipeline._make_executor", no_work)
    sources = corpus(tmp_path)
    folder = users_folder(tmp_path)
    before = state(folder)
    with pytest.raises(SystemExit) as exit_info:
        main(["prep", str(sources), "--out", str(folder)])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out {folder}: "), err
    assert "Traceback" not in err
    assert state(folder) == before


def test_an_empty_folder_and_a_dataset_are_written(tmp_path):
    sources = corpus(tmp_path)
    out = tmp_path / "out"
    out.mkdir()  # empty: fine
    first = run_prep(sources, out, executor="local")
    assert not first.up_to_date
    assert run_prep(sources, out, executor="local").up_to_date  # a dataset: up to date
    (tmp_path / "raw" / "c.txt").write_text(TEXT.replace("train", "teach"))
    again = run_prep(sources, out, executor="local")  # changed inputs: rebuilt in place
    assert not again.up_to_date and again.manifest["sources"]["a"]["docs_in"] == 3
