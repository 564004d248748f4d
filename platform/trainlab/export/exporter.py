"""The whole export: checkpoint -> Hugging Face model directory (see the package
docstring and docs/export.md)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainlab.data.prep.spec import DEFAULT_EOS_TOKEN
from trainlab.errors import UserError
from trainlab.export import hf
from trainlab.export.safetensors_out import Entry, write_all
from trainlab.export.source import CheckpointTensors, Located, locate
from trainlab.export.tokenizer import dataset_tokenizer, eos_of, write_tokenizer
from trainlab.fileutil import sha256_file
from trainlab.models.registry import arch_of

RECORD_FILE = "export.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1000000' -> bytes."""
    s = text.strip().upper().replace(" ", "")
    for unit in sorted(UNITS, key=len, reverse=True):
        if s.endswith(unit):
            number, scale = s[: -len(unit)], UNITS[unit]
            break
    else:
        number, scale = s, 1
    try:
        value = int(float(number) * scale)
    except ValueError:
        value = 0
    if value <= 0:
        raise UserError(f"--max-shard-size {text!r}: expected a size such as 5GB or 500MiB")
    return value


def _prepare_out(out: Path) -> Path:
    """A fresh staging directory beside `out` (renamed into place at the end)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not empty; choose another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _tokenizer(found: Located, given: str | Path | None) -> tuple[Path, str]:
    """The tokenizer file to ship and its end-of-document token: the run dataset's
    (checked against the checkpoint's dataset fingerprint), or `given`."""
    if given is None:
        fingerprint = found.checkpoint.meta.get("dataset_fingerprint")
        return dataset_tokenizer(found.cfg.data.path, fingerprint)
    tok_file = Path(given).expanduser().resolve()
    if not tok_file.is_file():
        raise UserError(f"--tokenizer {given}: no such file")
    try:
        _, eos_token = dataset_tokenizer(found.cfg.data.path, None)
    except UserError:  # the dataset is gone: prep's default end-of-document token
        eos_token = DEFAULT_EOS_TOKEN
    return tok_file, eos_token


def _weights(
    source: CheckpointTensors, plan: list[hf.HFTensor], target: torch.dtype
) -> tuple[list[Entry], Callable[[Entry], torch.Tensor]]:
    """The safetensors entries (shapes from the checkpoint's metadata, built on the
    meta device) and the function that builds one entry's tensor when written."""
    by_name = {t.name: t for t in plan}

    def shape(t: hf.HFTensor) -> tuple[int, ...]:
        metas = [torch.empty(source.specs[s].shape, device="meta") for s in t.sources]
        return tuple(t.build(metas).shape)

    entries = [Entry(t.name, shape(t), target) for t in plan]

    def tensor(e: Entry) -> torch.Tensor:
        t = by_name[e.name]
        return t.build([source.get(s).float() for s in t.sources]).to(target)

    return entries, tensor


def _export_measured(
    arch: Any, m: Any, source: CheckpointTensors, staging: Path, dtype: torch.dtype, eos_id: int
) -> tuple[list[str], int, int]:
    """An architecture brought by the user: its model built, the checkpoint's
    tensors loaded into it by name (every one must be there), then written by the
    architecture itself (hf:TYPE: save_pretrained)."""
    with torch.random.fork_rng(devices=[]):
        model = arch.build(m)
    state = model.state_dict()
    missing = sorted(set(state) - set(source.specs))
    if missing:
        raise UserError(
            f"the checkpoint lacks {len(missing)} tensors of {m.arch} (first: {missing[0]})"
        )
    for name, value in state.items():
        value.copy_(source.get(name))
    model = model.to(dtype)
    if hasattr(model, "hf"):  # the tokenizer's end of document
        model.hf.config.eos_token_id = eos_id
        if model.hf.generation_config is not None:
            model.hf.generation_config.eos_token_id = eos_id
    before = set(os.listdir(staging))
    arch.export(model, staging)
    files = sorted(set(os.listdir(staging)) - before)
    unique = {id(t): t for t in model.state_dict().values()}
    return files, len(state), sum(t.numel() * t.element_size() for t in unique.values())


def _checksums(directory: Path, files: list[str]) -> dict[str, dict[str, Any]]:
    return {
        name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
        for name in sorted(files)
    }


def export_model(
    path: str | Path,
    out: str | Path,
    step: int | None = None,
    dtype: str = "fp32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer: str | Path | None = None,
    track: bool = True,
) -> dict[str, Any]:
    """Export a checkpoint of the run (or checkpoint directory) at `path` to `out`.
    Returns the record also written as `out/export.json` (plus `out`,
    `mlflow_run_id` and `seconds`)."""
    if dtype not in hf.DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(hf.DTYPES)}")
    t0 = time.perf_counter()
    found = locate(path, step)
    m = found.cfg.model
    hf.check_exportable(m)
    tok_file, eos_token = _tokenizer(found, tokenizer)
    eos_id = eos_of(tok_file, eos_token)
    source = CheckpointTensors(found.checkpoint)
    arch = arch_of(m)
    out_dir = Path(out).expanduser().resolve()
    staging = _prepare_out(out_dir)
    try:
        if arch.measured:
            files, num_tensors, weights_bytes = _export_measured(
                arch, m, source, staging, hf.DTYPES[dtype], eos_id
            )
            hf_class = arch.causal_lm_class().__name__ if m.arch.startswith("hf:") else None
        else:
            specs = {k: v.shape for k, v in source.specs.items()}
            entries, tensor = _weights(source, hf.hf_tensors(m, specs), hf.DTYPES[dtype])
            files = write_all(staging, entries, tensor, max_shard_bytes)
            for name, content in (
                ("config.json", hf.hf_config(m, eos_id, dtype)),
                ("generation_config.json", hf.generation_config(eos_id)),
            ):
                (staging / name).write_text(json.dumps(content, indent=2) + "\n")
                files.append(name)
            num_tensors, weights_bytes = len(entries), sum(e.nbytes for e in entries)
            hf_class = hf.hf_class(m)
        files += write_tokenizer(staging, tok_file, eos_token, m.max_seq_len)
        checksums = _checksums(staging, files)
        record = {
            "format_version": 1,
            "run_dir": found.run,
            "checkpoint": found.checkpoint.where,
            "step": found.checkpoint.step,
            "checkpoint_format": source.format,
            "arch": m.arch,
            "hf_class": hf_class,
            "dtype": dtype,
            "num_tensors": num_tensors,
            "weights_bytes": weights_bytes,
            "files": checksums,
            # the export's checksum: one hash over every file's size and sha256
            "sha256": hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).hexdigest(),
        }
        (staging / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    run_id = None
    if track:
        from trainlab.export.record import log_export

        run_id = log_export(found.cfg, found.run, out_dir, record)
    return {
        **record,
        "out": str(out_dir),
        "mlflow_run_id": run_id,
        "seconds": round(time.perf_counter() - t0, 3),
    }
