"""Tokenizer training is deterministic (same inputs, same tokenizer.json, byte for
byte, in separate processes); a given tokenizer is used and recorded as is."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from trainlab.data.prep import run_prep
from trainlab.data.prep.tokenizer import token_dtype
from trainlab.errors import UserError

STDLIB = Path(sysconfig.get_paths()["stdlib"])

TRAIN = """
import hashlib, sys
from pathlib import Path
from trainlab.data.prep.spec import TokenizerTraining
from trainlab.data.prep.tokenizer import train_bpe
texts = [p.read_text() for p in sorted(Path(sys.argv[1]).glob("*.py"))]
data = train_bpe(texts, TokenizerTraining(vocab_size=1000), "<|endoftext|>")
print(hashlib.sha256(data).hexdigest())
"""


def train_in_subprocess(folder: Path, seed: str) -> str:
    # Different hash seeds: Python's and the Rust HashMaps' iteration orders differ.
    env = {"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", TRAIN, str(folder)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.stdout.strip()


def test_training_is_deterministic_across_processes():
    first = train_in_subprocess(STDLIB / "json", "1")
    assert first == train_in_subprocess(STDLIB / "json", "2")
    assert first != train_in_subprocess(STDLIB / "email", "1")


def sources(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(
        f'{extra}\nsources:\n  - {{name: code, paths: ["{STDLIB}/json/*.py"], format: text}}\n'
    )
    return path


def test_prep_trains_the_same_tokenizer_and_dataset_twice(tmp_path):
    path = sources(tmp_path, "train_tokenizer: {vocab_size: 400}")
    a = run_prep(path, tmp_path / "a", executor="local").manifest
    b = run_prep(path, tmp_path / "b", executor="local").manifest
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (
        tmp_path / "b/tokenizer.json"
    ).read_bytes()
    assert a["fingerprint"] == b["fingerprint"]
    assert a["tokenizer"]["vocab_size"] == 400 and a["tokenizer"]["eos_id"] == 0


def test_given_tokenizer_is_copied_as_is(tmp_path):
    trained = run_prep(
        sources(tmp_path, "train_tokenizer: {vocab_size: 300}"), tmp_path / "a", executor="local"
    ).manifest
    given = tmp_path / "a" / "tokenizer.json"
    m = run_prep(sources(tmp_path), tmp_path / "b", tokenizer=str(given), executor="local").manifest
    assert (tmp_path / "b/tokenizer.json").read_bytes() == given.read_bytes()
    assert m["tokenizer"]["sha256"] == hashlib.sha256(given.read_bytes()).hexdigest()
    assert m["fingerprint"] == trained["fingerprint"]


def test_tokenizer_without_the_eos_token_is_a_user_error(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.add_tokens(["hello"])
    tok.save(str(tmp_path / "noeos.json"))
    with pytest.raises(UserError, match=re.escape("no token '<|endoftext|>'")):
        run_prep(
            sources(tmp_path),
            tmp_path / "out",
            tokenizer=str(tmp_path / "noeos.json"),
            executor="local",
        )
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(UserError, match="not a tokenizers JSON file"):
        run_prep(
            sources(tmp_path),
            tmp_path / "out",
            tokenizer=str(tmp_path / "junk.json"),
            executor="local",
        )
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_ids_use_the_smallest_unsigned_type():
    assert token_dtype(8192) == token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "uint32"
