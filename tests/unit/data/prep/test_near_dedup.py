"""Near-duplicate removal (MinHash + LSH, `dedup.near` in the sources file) and the
hash-partitioned dedup: planted near-copies are found, nothing else is lost,
and the result does not depend on how many partitions or units did the work."""

from __future__ import annotations

import random
import re
import sysconfig
from pathlib import Path

import pytest

from trainlab.data.prep import run_prep
from trainlab.data.prep.dedup import lsh_bands, shingles, signature
from trainlab.data.prep.executors import LocalExecutor
from trainlab.data.prep.spec import NearDedupSettings, load_sources_file
from trainlab.errors import UserError

STDLIB = Path(sysconfig.get_paths()["stdlib"])
NEAR_ON = "dedup: {exact: true, near: {enabled: true, threshold: 0.8, num_perm: 128, ngram: 5}}"


def originals() -> list[str]:
    """Real text: the stdlib's asyncio modules of 300 words or more."""
    files = sorted((STDLIB / "asyncio").glob("*.py"))
    return [t for t in (f.read_text() for f in files) if len(t.split()) >= 300]


def near_copy(text: str, rng: random.Random) -> str:
    """A few words in a thousand replaced, and a line appended."""
    parts = re.split(r"(\s+)", text)  # words at even indices, whitespace kept
    words = [i for i in range(0, len(parts), 2) if parts[i]]
    for i in rng.sample(words, max(1, len(words) * 3 // 1000)):
        parts[i] = f"changed{rng.randrange(10**6)}"
    return "".join(parts) + "\n# one more line appended to the copy\n"


def write_corpus(root: Path, texts: list[str], copies: list[str]) -> Path:
    (root / "orig").mkdir(parents=True)
    for i, t in enumerate(texts):
        (root / "orig" / f"{i:03d}.txt").write_text(t)
    if copies:
        (root / "copies").mkdir()
        for i, t in enumerate(copies):
            (root / "copies" / f"{i:03d}.txt").write_text(t)
    sources = ["  - {name: orig, paths: [orig/], format: text}"]
    if copies:
        sources.append("  - {name: copies, paths: [copies/], format: text}")
    path = root / "s.yaml"
    path.write_text(
        f"train_tokenizer: {{vocab_size: 400}}\nshard_target_mb: 0.05\n{NEAR_ON}\n"
        "sources:\n" + "\n".join(sources) + "\n"
    )
    return path


def test_planted_near_copies_are_found_and_nothing_else_is_lost(tmp_path):
    texts = originals()
    rng = random.Random(0)
    planted = [near_copy(t, rng) for t in texts[::2]]
    s = NearDedupSettings(enabled=True)
    for orig, copy in zip(texts[::2], planted, strict=True):  # the corpus is what it claims
        a, b = set(shingles(orig, s)), set(shingles(copy, s))
        assert len(a & b) / len(a | b) > 0.9

    base = run_prep(write_corpus(tmp_path / "base", texts, []), tmp_path / "b", executor="local")
    with_copies = run_prep(
        write_corpus(tmp_path / "planted", texts, planted),
        tmp_path / "p",
        executor="local",
        tokenizer=str(tmp_path / "b" / "tokenizer.json"),
    )
    found = with_copies.manifest["sources"]["copies"]["rejected"]["near_duplicate"]
    assert found["count"] / len(planted) >= 0.95
    assert found["examples"][0].endswith("copies/000.txt")
    # The originals lose exactly what they lose without the planted copies: the
    # same accounts and the same shards, byte for byte.
    assert base.manifest["sources"]["orig"] == with_copies.manifest["sources"]["orig"]
    assert with_copies.manifest["sources"]["copies"]["docs_out"] == len(planted) - found["count"]


def test_near_dedup_off_keeps_near_copies_and_exact_off_keeps_copies(tmp_path):
    texts = originals()[:6]
    copies = [near_copy(texts[0], random.Random(1)), texts[1]]
    path = write_corpus(tmp_path, texts, copies)
    off = path.read_text().replace(NEAR_ON, "dedup: {exact: false}")
    path.write_text(off)
    m = run_prep(path, tmp_path / "out", executor="local").manifest
    assert m["sources"]["copies"]["docs_out"] == 2
    assert m["cleaning"]["dedup"]["near"]["enabled"] is False


class Wide(LocalExecutor):
    """In-process, but planned like a big cluster: many dedup partitions."""

    parallelism = 16


def test_result_is_independent_of_partitions_and_units(tmp_path):
    texts = originals()[:12]
    rng = random.Random(2)
    path = write_corpus(tmp_path, texts, [near_copy(t, rng) for t in texts[:4]] + texts[4:6])
    one = run_prep(path, tmp_path / "one", executor="local", unit_bytes=1 << 30)
    many = run_prep(path, tmp_path / "many", executor=Wide(), unit_bytes=1)
    assert one.units_total == 2 and many.units_total == len(texts) + 6
    assert one.manifest == many.manifest
    rejected = one.manifest["sources"]["copies"]["rejected"]
    assert rejected["duplicate"]["count"] == 2 and rejected["near_duplicate"]["count"] == 4


def test_minhash_estimates_jaccard_and_bands_follow_datasketch():
    s = NearDedupSettings(enabled=True, num_perm=256)
    text = " ".join(f"w{i}" for i in range(400))
    other = " ".join(f"w{i}" for i in range(200, 600))  # 196 of 596 5-grams shared
    est = (signature(text, s) == signature(other, s)).mean()
    assert abs(est - 196 / 596) < 0.08
    assert (signature(text, s) == signature(text, s)).all()
    bands, rows = lsh_bands(0.8, 128)
    assert bands * rows <= 128 and bands > 1


@pytest.mark.parametrize(
    "dedup, message",
    [
        ("{near: {threshold: 1.5}}", "dedup.near.threshold = 1.5"),
        ("{near: {ngram: 0}}", "dedup.near.ngram = 0"),
        ("{near: {shingle: bytes}}", "dedup.near.shingle"),
        ("{exact: maybe}", "dedup.exact"),
        ("{fuzzy: true}", "dedup.fuzzy: unknown key"),
    ],
)
def test_bad_dedup_settings_are_user_errors(tmp_path, dedup, message):
    path = tmp_path / "s.yaml"
    path.write_text(f"dedup: {dedup}\nsources: [{{name: a, paths: [x], format: text}}]\n")
    with pytest.raises(UserError, match=message.replace(".", r"\.")):
        load_sources_file(path)


def test_dedup_defaults_are_the_documented_interface(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("sources: [{name: a, paths: [x], format: text}]\n")
    dedup = load_sources_file(path).dedup.model_dump()
    assert dedup["exact"] is True
    assert {k: dedup["near"][k] for k in ("enabled", "threshold", "num_perm", "ngram")} == {
        "enabled": False,
        "threshold": 0.8,
        "num_perm": 128,
        "ngram": 5,
    }
