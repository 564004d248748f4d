"""Re-running with the same inputs does no work; a changed input or setting
rebuilds; a run killed midway leaves no finished-looking dataset and the next run
completes it correctly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from trainlab.data.prep import run_prep
from trainlab.data.prep.executors import LocalExecutor
from trainlab.data.prep.spec import DEFAULT_EOS_TOKEN, TokenizerTraining
from trainlab.data.prep.tokenizer import train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def make_corpus(tmp_path: Path, shard_mb: float = 0.01) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    for p in sorted((STDLIB / "json").glob("*.py")):
        (raw / p.name).write_bytes(p.read_bytes())
    path = tmp_path / "s.yaml"
    path.write_text(
        f"root: raw\ntrain_tokenizer: {{vocab_size: 300}}\n"
        f"shard_target_mb: {shard_mb}\n"
        'sources: [{name: code, paths: ["*.py"], format: text}]\n'
    )
    return path


def snapshot(out: Path) -> dict[str, int]:
    return {
        p.relative_to(out).as_posix(): p.stat().st_mtime_ns
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def test_rerun_is_up_to_date_and_touches_nothing(tmp_path):
    sources = make_corpus(tmp_path)
    first = run_prep(sources, tmp_path / "out", executor="local")
    before = snapshot(tmp_path / "out")

    class NoWork(LocalExecutor):
        def map_items(self, *args, **kwargs):
            raise AssertionError("an up-to-date dataset must not be rebuilt")

    again = run_prep(sources, tmp_path / "out", executor=NoWork())
    assert again.up_to_date and not first.up_to_date
    assert again.manifest == first.manifest
    assert snapshot(tmp_path / "out") == before


@pytest.mark.parametrize("change", ["edit_input", "add_input", "setting", "vocab", "corrupt"])
def test_a_change_rebuilds(tmp_path, change):
    sources = make_corpus(tmp_path)
    first = run_prep(sources, tmp_path / "out", executor="local").manifest
    vocab = None
    if change == "edit_input":
        (tmp_path / "raw/tool.py").write_text("print('a different tool')\n")
    elif change == "add_input":
        (tmp_path / "raw/new.py").write_text("x = 1  # a new file\n")
    elif change == "setting":
        sources.write_text(sources.read_text() + "cleaning: {min_chars: 2000}\n")
    elif change == "vocab":
        vocab = 320
    elif change == "corrupt":
        shard = tmp_path / "out" / first["sources"]["code"]["shards"][0]["file"]
        shard.write_bytes(shard.read_bytes()[:-10])
    result = run_prep(sources, tmp_path / "out", vocab_size=vocab, executor="local")
    assert not result.up_to_date
    if change == "corrupt":
        assert result.manifest["fingerprint"] == first["fingerprint"]
    else:
        assert result.manifest["fingerprint"] != first["fingerprint"]


class CrashAfter(LocalExecutor):
    """Dies (like a killed process would) after `n` units, or in the shard-writing
    stage after `n` shards."""

    def __init__(self, n: int, stage: str = "unit_stage"):
        self.n, self.stage = n, stage

    def map_items(self, items, stage, kwargs, **options):
        for i, table in enumerate(super().map_items(items, stage, kwargs, **options)):
            if i == self.n and stage.__name__ == self.stage:
                raise KeyboardInterrupt
            yield table


def test_interrupted_run_leaves_no_manifest_and_rerun_completes(tmp_path):
    sources = make_corpus(tmp_path)
    clean = run_prep(sources, tmp_path / "clean", executor="local", unit_bytes=1).manifest
    out = tmp_path / "out"
    # An earlier, complete build with bigger shards: after a crashed rebuild its
    # manifest must be gone, and its extra shards must not survive the next build.
    sources.write_text(sources.read_text().replace("shard_target_mb: 0.01", "shard_target_mb: 1"))
    run_prep(sources, out, executor="local")
    sources.write_text(sources.read_text().replace("shard_target_mb: 1", "shard_target_mb: 0.01"))
    with pytest.raises(KeyboardInterrupt):
        run_prep(sources, out, executor=CrashAfter(3, "write_stage"), unit_bytes=1)
    assert not (out / "manifest.json").exists()
    assert list((out / "code").glob("part-*.parquet"))  # some shards were written
    (out / "code" / ".part-00009.parquet.tmp-99999").write_bytes(b"half a shard")

    result = run_prep(sources, out, executor="local")
    assert not result.up_to_date
    assert result.manifest["fingerprint"] == clean["fingerprint"]
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    listed = sorted(s["file"] for s in result.manifest["sources"]["code"]["shards"])
    assert on_disk == sorted([*listed, "manifest.json", "tokenizer.json"])


KILLABLE = """
import sys
from trainlab.data.prep import run_prep
run_prep(sys.argv[1], sys.argv[2], tokenizer=sys.argv[3], executor="local", unit_bytes=1)
"""


def files_of(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_process_killed_at_half_its_units_resumes_them(tmp_path):
    """A real SIGKILL once about half the work units are recorded: the re-run
    reuses at least those and gives a byte-identical dataset."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for p in sorted((STDLIB / "email").glob("*.py")):
        (raw / p.name).write_bytes(p.read_bytes())
    sources = tmp_path / "s.yaml"
    sources.write_text(
        "root: raw\nshard_target_mb: 0.01\n"
        "dedup: {near: {enabled: true, num_perm: 512}}\n"  # slower units: time to kill
        'sources: [{name: code, paths: ["*.py"], format: text}]\n'
    )
    tokenizer = str(tmp_path / "tokenizer.json")
    texts = [p.read_text() for p in sorted((STDLIB / "json").glob("*.py"))]
    Path(tokenizer).write_bytes(
        train_bpe(texts, TokenizerTraining(vocab_size=400), DEFAULT_EOS_TOKEN)
    )
    reference = run_prep(
        sources, tmp_path / "reference", tokenizer=tokenizer, executor="local", unit_bytes=1
    )
    total = reference.units_total
    assert total == len(list(raw.glob("*.py"))) >= 10

    out = tmp_path / "out"
    recorded = out / ".prep-work" / "units"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLABLE, str(sources), str(out), tokenizer],
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(recorded.glob("*.docs.arrow"))) >= total // 2:
            break
        time.sleep(0.002)
    assert proc.poll() is None, "prep finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list(recorded.glob("*.docs.arrow")))
    assert total // 2 <= done < total
    assert not (out / "manifest.json").exists()

    result = run_prep(sources, out, tokenizer=tokenizer, executor="local", unit_bytes=1)
    assert (result.units_total, result.units_reused) == (total, done)
    assert files_of(out) == files_of(tmp_path / "reference")  # work dir gone, bytes equal
    assert run_prep(sources, out, tokenizer=tokenizer, executor="local").up_to_date


def test_a_changed_input_invalidates_only_its_units(tmp_path):
    """(With a given tokenizer: a trained one changes with its sample, and so
    invalidates every unit.)"""
    sources = make_corpus(tmp_path)
    tokenizer = str(tmp_path / "tokenizer.json")
    texts = [p.read_text() for p in sorted((STDLIB / "json").glob("*.py"))]
    Path(tokenizer).write_bytes(
        train_bpe(texts, TokenizerTraining(vocab_size=300), "<|endoftext|>")
    )
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_prep(
            sources, out, tokenizer=tokenizer, executor=CrashAfter(0, "reduce_stage"), unit_bytes=1
        )
    units = sorted((out / ".prep-work" / "units").glob("*.docs.arrow"))
    (tmp_path / "raw/tool.py").write_text("print('a different tool')\n")
    result = run_prep(sources, out, tokenizer=tokenizer, executor="local", unit_bytes=1)
    assert result.units_reused == result.units_total - 1 == len(units) - 1
