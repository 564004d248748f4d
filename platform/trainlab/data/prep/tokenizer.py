"""The tokenizer of a prepared dataset: trained on the sources, or given as a file.

Training is deterministic: a byte-level BPE (no normalizer, so decoding gives
back the exact text) fed the same texts in the same order yields the same
`tokenizer.json`, byte for byte. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from trainlab.data.prep.spec import TokenizerTraining
from trainlab.errors import UserError


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about the tokenizer."""

    file: str
    sha256: str
    vocab_size: int
    eos_id: int
    eos_token: str
    dtype: str

    def to_json(self) -> dict:
        return asdict(self)


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned integer type that holds every id."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def train_bpe(texts: Iterable[str], settings: TokenizerTraining, eos_token: str) -> bytes:
    """A byte-level BPE trained on `texts`; returns the tokenizer JSON (bytes).
    The EOS token is the first special token, so its id is 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=settings.vocab_size,
        min_frequency=settings.min_frequency,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str().encode("utf-8")


def read_tokenizer_file(path: Path) -> bytes:
    """The bytes of a given tokenizer.json; UserError when missing or not loadable."""
    from tokenizers import Tokenizer

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"--tokenizer {path}: file not found") from None
    except OSError as e:
        raise UserError(f"--tokenizer {path}: cannot read ({e.strerror or e})") from None
    try:
        Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"--tokenizer {path}: not a tokenizers JSON file ({reason})") from None
    return data


def describe(tokenizer_json: bytes, eos_token: str, origin: str) -> TokenizerInfo:
    """Vocabulary size, EOS id and id dtype of a tokenizer; UserError without EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise UserError(
            f"{origin}: tokenizer has no token {eos_token!r} to end documents "
            "with (set eos_token in the sources file)"
        )
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    return TokenizerInfo(
        "tokenizer.json",
        sha256_bytes(tokenizer_json),
        vocab_size,
        eos_id,
        eos_token,
        token_dtype(vocab_size),
    )
