"""The sources file, path listing and the CLI's user errors: everything wrong with
the input is reported before any work, as one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainlab.cli import main
from trainlab.data.prep.paths import glob_to_regex, list_source_files
from trainlab.data.prep.pipeline import run_prep
from trainlab.data.prep.spec import load_sources_file
from trainlab.errors import UserError


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def sources_yaml(tmp_path: Path, body: str) -> Path:
    return write(tmp_path / "sources.yaml", body)


GOOD = """
train_tokenizer: {vocab_size: 300}
sources:
  - name: a
    paths: [raw/]
    format: text
"""


@pytest.mark.parametrize(
    "body, expected",
    [
        ("sources: [", "invalid YAML"),
        ("- just a list", "top level must be a mapping"),
        ("sources: []", "sources = []: list should have at least 1 item"),
        ("sources:\n  - {name: a, paths: [x], format: csv}", "sources.0.format = 'csv'"),
        ("sources:\n  - {name: a, paths: [x], format: jsonl}", "needs text_field"),
        ("sources:\n  - {name: a, paths: [x], format: text, text_field: t}", "takes no text_field"),
        (
            "sources:\n  - {name: a, paths: [x], format: text}\n  - {name: a, paths: [y], format: text}",
            "source name 'a' is used twice",
        ),
        ("colour: red\nsources:\n  - {name: a, paths: [x], format: text}", "colour: unknown key"),
        (
            "sources:\n  - {name: a, paths: [x], format: text, cleaning: {min_chars: 0}}",
            "sources.0.cleaning.min_chars = 0",
        ),
        (
            "cleaning: {min_chars: 10, max_chars: 5}\nsources:\n  - {name: a, paths: [x], format: text}",
            "min_chars (10) must be <= max_chars (5)",
        ),
        (
            "tokenizer: t.json\ntrain_tokenizer: {vocab_size: 300}\n"
            "sources:\n  - {name: a, paths: [x], format: text}",
            "either tokenizer or train_tokenizer",
        ),
    ],
)
def test_bad_sources_file_names_the_field(tmp_path, body, expected):
    path = sources_yaml(tmp_path, body)
    with pytest.raises(UserError) as err:
        load_sources_file(path)
    assert expected in str(err.value)
    assert str(path) in str(err.value)


def test_missing_sources_file(tmp_path):
    with pytest.raises(UserError, match="sources file not found"):
        load_sources_file(tmp_path / "nope.yaml")


def test_per_source_cleaning_overrides_defaults(tmp_path):
    spec = load_sources_file(
        sources_yaml(
            tmp_path,
            """
cleaning: {min_chars: 10, max_chars: 100}
sources:
  - {name: a, paths: [x], format: text, cleaning: {max_chars: 50}}
  - {name: b, paths: [x], format: text}
""",
        )
    )
    assert spec.cleaning_for(spec.sources[0]).model_dump() == {"min_chars": 10, "max_chars": 50}
    assert spec.cleaning_for(spec.sources[1]).model_dump() == {"min_chars": 10, "max_chars": 100}


@pytest.mark.parametrize(
    "pattern, matches, misses",
    [
        ("/r/**/*.py", ["/r/a.py", "/r/x/y/a.py"], ["/r/a.pyc", "/q/a.py"]),
        ("/r/*.txt", ["/r/a.txt"], ["/r/x/a.txt"]),
        ("/r/[ab]?.md", ["/r/a1.md", "/r/bz.md"], ["/r/c1.md", "/r/a.md"]),
        ("/r/[!a]*.md", ["/r/b.md"], ["/r/a.md"]),
        ("/r/**", ["/r/a", "/r/x/y"], ["/q/a"]),
    ],
)
def test_glob_patterns(pattern, matches, misses):
    regex = glob_to_regex(pattern)
    assert all(regex.match(m) for m in matches)
    assert not any(regex.match(m) for m in misses)


def test_listing_sorts_dedups_and_skips_hidden(tmp_path):
    for rel in ("b/2.txt", "a.txt", "b/1.txt", ".hidden.txt", "b/.git/x.txt", "c.md"):
        write(tmp_path / rel, "x")
    files = list_source_files(["*.txt", "b/", "a.txt", "**/*.txt"], tmp_path, "s")
    assert [Path(f.location).relative_to(tmp_path).as_posix() for f in files] == [
        "a.txt",
        "b/1.txt",
        "b/2.txt",
    ]
    # A file:// URI names the same files as their path.
    uri_files = list_source_files([f"file://{tmp_path}/b/*.txt"], tmp_path, "s")
    assert [f.location for f in uri_files] == [
        f"{tmp_path}/b/1.txt",
        f"{tmp_path}/b/2.txt",
    ]


@pytest.mark.parametrize(
    "entry, message",
    [
        ("missing/", "path does not exist"),
        ("raw/*.json", "glob matches no files"),
        ("nodir/**/*.txt", "glob matches no files"),
        ("emptydir", "directory holds no files"),
    ],
)
def test_paths_that_yield_nothing_are_errors(tmp_path, entry, message):
    write(tmp_path / "raw" / "a.txt", "hello")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(UserError, match=message) as err:
        list_source_files([entry], tmp_path, "s")
    assert "source 's'" in str(err.value)


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["prep", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.mark.parametrize(
    "case",
    [
        "no_file",
        "bad_yaml",
        "bad_field",
        "missing_path",
        "empty_glob",
        "both_flags",
        "bad_tokenizer",
    ],
)
def test_cli_user_errors_exit_2_with_one_line_and_no_output(tmp_path, capsys, case):
    write(tmp_path / "raw" / "a.txt", "some text here")
    path = sources_yaml(tmp_path, GOOD)
    args = [str(path), "--out", str(tmp_path / "out")]
    if case == "no_file":
        args[0] = str(tmp_path / "missing.yaml")
    elif case == "bad_yaml":
        sources_yaml(tmp_path, "sources:\n  - name: [a\n")
    elif case == "bad_field":
        sources_yaml(tmp_path, GOOD.replace("format: text", "format: txt"))
    elif case == "missing_path":
        sources_yaml(tmp_path, GOOD.replace("raw/", "nowhere/"))
    elif case == "empty_glob":
        sources_yaml(tmp_path, GOOD.replace("raw/", "raw/*.jsonl"))
    elif case == "both_flags":
        args += ["--tokenizer", str(path), "--vocab-size", "300"]
    elif case == "bad_tokenizer":
        args += ["--tokenizer", str(path)]
    code, out, err = run_cli(args, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert out == ""
    assert not (tmp_path / "out").exists()


def test_vocab_size_flag_overrides_the_file(tmp_path):
    write(tmp_path / "raw" / "a.txt", "some text here, long enough to train on " * 20)
    path = sources_yaml(tmp_path, GOOD)
    result = run_prep(path, tmp_path / "out", vocab_size=320, executor="local")
    assert result.manifest["tokenizer"]["vocab_size"] <= 320
    with pytest.raises(UserError, match="--vocab-size 10"):
        run_prep(path, tmp_path / "out", vocab_size=10, executor="local")
