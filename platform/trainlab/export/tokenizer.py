"""The dataset's tokenizer as a transformers `PreTrainedTokenizerFast`.

`trainlab prep` records the tokenizer it used (DIR/tokenizer.json, a Hugging
Face tokenizers file) and its end-of-document token in manifest.json
(docs/contracts.md, section 2). transformers needs that file next to a
tokenizer_config.json naming the class and the special tokens. Documents were
trained as `tokens + [EOS]` with no BOS, so no template adds tokens: the ids
`AutoTokenizer` gives for a text are those the model was trained on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from trainlab.data.manifest import MANIFEST, resolve_dataset_dir
from trainlab.errors import UserError
from trainlab.fileutil import sha256_file
from trainlab.nodedisk import scratch_root

TOKENIZER_FILE = "tokenizer.json"


def dataset_tokenizer(data_path: str, fingerprint: str | None) -> tuple[Path, str]:
    """(tokenizer.json, its EOS token) of the run's prepared dataset, checked
    against the manifest and, when known, the fingerprint the checkpoint trained on.
    A dataset in object storage has its tokenizer copied to this node's scratch."""
    where = resolve_dataset_dir(data_path)
    manifest = json.loads(where.read_bytes(MANIFEST).decode("utf-8"))
    tok = manifest.get("tokenizer") or {}
    rel = str(tok.get("file") or TOKENIZER_FILE)
    if fingerprint and manifest.get("fingerprint") != fingerprint:
        raise UserError(
            f"data.path {where}: its dataset changed since the checkpoint (fingerprint "
            f"{manifest.get('fingerprint')} != {fingerprint}); pass --tokenizer with the "
            "tokenizer.json the model was trained with"
        )
    try:
        path = where.file_here(rel, scratch_root() / "datasets")  # checked below
    except FileNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise UserError(f"{where.uri_of(rel)}: the dataset's tokenizer is missing")
    if tok.get("sha256") and sha256_file(path) != tok["sha256"]:
        raise UserError(
            f"{where.uri_of(rel)}: does not match the sha256 in {where.uri_of(MANIFEST)}"
        )
    eos = tok.get("eos_token")
    if not isinstance(eos, str):
        raise UserError(f"{where.uri_of(MANIFEST)}: tokenizer.eos_token missing")
    return path, eos


def eos_of(tokenizer_file: Path, eos_token: str) -> int:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # noqa: BLE001 - any parse failure is the file's fault
        raise UserError(f"{tokenizer_file}: not a tokenizers JSON file ({e})") from None
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise UserError(f"{tokenizer_file}: has no token {eos_token!r}")
    return eos_id


def write_tokenizer(out: Path, tokenizer_file: Path, eos_token: str, max_len: int) -> list[str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json in `out`."""
    shutil.copyfile(tokenizer_file, out / TOKENIZER_FILE)
    special = {"eos_token": eos_token, "bos_token": eos_token, "pad_token": eos_token}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return [TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json"]
