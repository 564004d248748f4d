"""Small prepared datasets in the contract-2 format, for tests and benchmarks.

Real text (the Python standard library's source and docstrings), a real
byte-level BPE tokenizer trained on it, real token ids. `trainlab prep` is the
way to prepare data for training; this writes the same format directly so the
loader can be tested without running prep (and without Ray).
"""

from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

EOS_TOKEN = "<|endoftext|>"


def stdlib_files(limit: int, min_bytes: int = 200) -> list[Path]:
    """The first `limit` standard-library .py files (sorted, stable across runs)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.glob("*.py")) if p.stat().st_size >= min_bytes]
    return files[:limit]


def stdlib_code(limit: int, max_chars: int = 40_000) -> list[str]:
    """Source files of the standard library (real code documents, some long)."""
    return [
        p.read_text(encoding="utf-8", errors="replace")[:max_chars] for p in stdlib_files(limit)
    ]


def stdlib_docstrings(limit: int) -> list[str]:
    """Docstrings of standard-library modules and their functions (real prose)."""
    out: list[str] = []
    for p in stdlib_files(10 * limit):
        try:
            tree = ast.parse(p.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    out.append(doc)
                    if len(out) >= limit:
                        return out
    return out


def train_tokenizer(texts: Sequence[str], vocab_size: int = 2048) -> Any:
    """A byte-level BPE tokenizer with EOS as id 0 (tokenizers.Tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter(texts), trainer)
    return tok


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _chunks(items: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def write_prepared_dataset(
    root: str | Path, texts: Mapping[str, Sequence[str]], tokenizer: Any, docs_per_shard: int = 1000
) -> dict[str, Any]:
    """Tokenize `texts` ({source: documents}) and write DIR in the prepared format;
    return the manifest dict."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(root / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    vocab = tokenizer.get_vocab_size()
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    sources: dict[str, Any] = {}
    for name, docs in texts.items():
        (root / name).mkdir(exist_ok=True)
        shards = []
        for i, chunk in enumerate(_chunks(list(docs), docs_per_shard)):
            ids = [e.ids + [eos_id] for e in tokenizer.encode_batch(list(chunk))]
            table = pa.table(
                {
                    "doc_id": [hashlib.sha256(t.encode()).hexdigest()[:32] for t in chunk],
                    "source": [name] * len(chunk),
                    "tokens": pa.array(ids, type=pa.list_(getattr(pa, dtype)())),
                    "n_tokens": pa.array([len(x) for x in ids], type=pa.int64()),
                }
            )
            rel = f"{name}/part-{i:05d}.parquet"
            pq.write_table(table, root / rel, compression="zstd")
            shards.append(
                {
                    "file": rel,
                    "rows": len(chunk),
                    "tokens": sum(map(len, ids)),
                    "sha256": _sha256(root / rel),
                }
            )
        sources[name] = {
            "docs_in": len(docs),
            "docs_out": len(docs),
            "tokens": sum(s["tokens"] for s in shards),
            "rejected": {},
            "shards": shards,
        }
    tok_sha = _sha256(root / "tokenizer.json")
    cleaning = {"written_by": "trainlab.data.testing"}
    blob = json.dumps(
        [tok_sha, cleaning, [s["sha256"] for src in sources.values() for s in src["shards"]]],
        sort_keys=True,
    )
    manifest = {
        "format_version": 1,
        "fingerprint": hashlib.sha256(blob.encode()).hexdigest(),
        "tokenizer": {
            "file": "tokenizer.json",
            "sha256": tok_sha,
            "vocab_size": vocab,
            "eos_id": eos_id,
            "eos_token": EOS_TOKEN,
            "dtype": dtype,
        },
        "cleaning": cleaning,
        "sources": sources,
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def write_stdlib_dataset(
    root: str | Path, code_docs: int = 120, prose_docs: int = 300, vocab_size: int = 2048
) -> dict[str, Any]:
    """Two real sources: `code` (stdlib modules, long documents) and `docs` (docstrings,
    short ones), tokenized with a BPE trained on them."""
    texts = {"code": stdlib_code(code_docs), "docs": stdlib_docstrings(prose_docs)}
    tok = train_tokenizer([t for docs in texts.values() for t in docs], vocab_size)
    return write_prepared_dataset(root, texts, tok)


def small_dataset(root: str | Path) -> Path:
    """A small three-source dataset at `root` (written once; reused if present):
    `code` (long documents), `docs` (short ones) and `tiny` (a handful of
    documents, so any real share of it repeats for several epochs)."""
    root = Path(root)
    if not (root / "manifest.json").exists():
        docstrings = stdlib_docstrings(160)
        texts = {
            "code": stdlib_code(24, max_chars=12_000),
            "docs": docstrings[:150],
            "tiny": docstrings[150:156],
        }
        tok = train_tokenizer([t for docs in texts.values() for t in docs], vocab_size=1024)
        write_prepared_dataset(root, texts, tok, docs_per_shard=64)
    return root
