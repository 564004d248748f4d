"""`run_prep`: sources file in, prepared dataset directory out (contract 2).

    check everything (sources file, paths, tokenizer, output dir)   -> UserError, no work
    up to date?  (same inputs and settings, every file intact)      -> return at once
    [train the tokenizer on a hash-sampled slice of the cleaned text]
    read -> clean -> hash -> tokenize  (Ray Data, units in order)
    dedup + account + write shards     (this process, in order)
    manifest.json last, atomically

A run killed at any point leaves no manifest (the old one is removed before
anything is overwritten), so the next run rebuilds instead of trusting a
half-written directory; stale shards and temporary files are swept at the end.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from trainlab.data.prep.cleaning import CLEANING_RULES, CLEANING_RULES_VERSION
from trainlab.data.prep.executors import LocalExecutor, RayDataExecutor, SampleStage
from trainlab.data.prep.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    build_manifest,
    current_manifest,
    listed_files,
    read_manifest,
    signature,
    write_manifest,
)
from trainlab.data.prep.paths import list_source_files
from trainlab.data.prep.shards import DatasetWriter, SourceAccount, atomic_write_bytes
from trainlab.data.prep.spec import (
    SOURCE_NAME_PATTERN,
    SourcesFile,
    TokenizerTraining,
    choose_tokenizer,
    load_sources_file,
    resolve_root,
)
from trainlab.data.prep.tokenizer import (
    TokenizerInfo,
    describe,
    read_tokenizer_file,
    sha256_bytes,
    train_bpe,
)
from trainlab.data.prep.units import SourceFiles, TokenizeStage, WorkUnit, plan_units
from trainlab.data.prep.units import unit_target_bytes as default_unit_bytes
from trainlab.errors import UserError

MB = 1 << 20
TOKENIZER_FILE = "tokenizer.json"

# (phase, bytes of raw input done, bytes in total); phases: "sample", "tokenize".
ProgressFn = Callable[[str, int, int], None]


class Executor(Protocol):
    parallelism: int
    tokenizer_threads: bool

    def map_units(
        self, units: list[WorkUnit], stage_cls: type, stage_kwargs: dict[str, Any]
    ) -> Iterable[pa.Table]: ...


@dataclass
class PrepResult:
    out_dir: Path
    manifest: dict
    up_to_date: bool
    seconds: float
    # Wall seconds per phase: check, train_tokenizer, tokenize_write (of which
    # dedup_write_in_driver is this process's own work), finish; and CPU seconds
    # the workers spent in cpu_read_clean and cpu_tokenize.
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Inputs:
    spec: SourcesFile
    sources: list[SourceFiles]
    tokenizer_json: bytes | None  # given tokenizer; None when it is to be trained
    training: TokenizerTraining | None
    signature: str
    cleaning: dict

    @property
    def total_bytes(self) -> int:
        return sum(f.size for s in self.sources for f in s.files)


def run_prep(
    sources: str | Path,
    out: str | Path,
    *,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    executor: str | Executor = "ray",
    progress: ProgressFn | None = None,
    unit_bytes: int | None = None,
) -> PrepResult:
    """Prepare the dataset described by the sources file `sources` into `out`.

    `tokenizer` / `vocab_size` override the sources file's tokenizer choice.
    `executor`: "ray" (Ray Data on `trainlab.raycluster.ensure_ray()`), "local"
    (this process, no Ray), or an executor object. `unit_bytes` fixes the size of
    a work unit (default: from the corpus size and the parallelism).
    """
    t0 = time.perf_counter()
    out_dir = Path(out)
    inputs = _check_inputs(Path(sources), tokenizer, vocab_size)
    _prepare_out_dir(out_dir)
    timings = {"check": time.perf_counter() - t0}
    existing = current_manifest(out_dir, inputs.signature)
    if existing is not None:
        return PrepResult(out_dir, existing, True, time.perf_counter() - t0, timings)

    ex = _make_executor(executor)
    units = plan_units(
        inputs.sources, unit_bytes or default_unit_bytes(inputs.total_bytes, ex.parallelism)
    )
    old_manifest = read_manifest(out_dir)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # from here on the directory is unfinished

    t = time.perf_counter()
    tokenizer_json = inputs.tokenizer_json
    if tokenizer_json is None:
        assert inputs.training is not None
        tokenizer_json = _train_tokenizer(ex, units, inputs, progress)
    info = describe(tokenizer_json, inputs.spec.eos_token, "trained tokenizer")
    atomic_write_bytes(out_dir / TOKENIZER_FILE, tokenizer_json)
    timings["train_tokenizer"] = time.perf_counter() - t

    t = time.perf_counter()
    accounts, spent = _tokenize_and_write(
        ex, units, inputs, tokenizer_json, info, out_dir, progress
    )
    timings["tokenize_write"] = time.perf_counter() - t
    timings.update(spent)

    t = time.perf_counter()
    manifest = build_manifest(info, inputs.cleaning, accounts, inputs.signature)
    _remove_stale_files(out_dir, manifest, old_manifest)
    write_manifest(out_dir, manifest)
    timings["finish"] = time.perf_counter() - t
    return PrepResult(out_dir, manifest, False, time.perf_counter() - t0, timings)


# --------------------------------------------------------------------------- checks


def _check_inputs(sources_path: Path, tokenizer: str | None, vocab_size: int | None) -> _Inputs:
    """Everything that can be wrong with the user's input, found before any work."""
    spec = load_sources_file(sources_path)
    root = resolve_root(sources_path, spec)
    kind, value = choose_tokenizer(sources_path, spec, tokenizer, vocab_size)
    tokenizer_json, training = None, None
    if kind == "file":
        tokenizer_json = read_tokenizer_file(Path(value))  # type: ignore[arg-type]
        describe(tokenizer_json, spec.eos_token, str(value))
    else:
        training = value  # type: ignore[assignment]
    sources = [
        SourceFiles(
            s.name,
            s.format,
            s.text_field,
            spec.cleaning_for(s),
            list_source_files(s.paths, root, s.name),
        )
        for s in spec.sources
    ]
    cleaning = {
        "rules_version": CLEANING_RULES_VERSION,
        "rules": CLEANING_RULES,
        "sources": {s.name: s.cleaning.model_dump() for s in sources},
    }
    return _Inputs(
        spec,
        sources,
        tokenizer_json,
        training,
        _input_signature(spec, sources, tokenizer_json, training, cleaning),
        cleaning,
    )


def _input_signature(
    spec: SourcesFile,
    sources: list[SourceFiles],
    tokenizer_json: bytes | None,
    training: TokenizerTraining | None,
    cleaning: dict,
) -> str:
    """Identifies every input and setting the output depends on (files by location,
    size and mtime; library versions that change bytes or merges)."""
    import pyarrow
    import tokenizers

    return signature(
        {
            "format_version": FORMAT_VERSION,
            "cleaning": cleaning,
            "sources": [
                {
                    "name": s.name,
                    "format": s.format,
                    "text_field": s.text_field,
                    "files": [[f.location, f.size, f.mtime_ns] for f in s.files],
                }
                for s in sources
            ],
            "tokenizer": (
                sha256_bytes(tokenizer_json)
                if tokenizer_json is not None
                else training.model_dump()
                if training
                else None
            ),
            "eos_token": spec.eos_token,
            "shard_target_mb": spec.shard_target_mb,
            "versions": {"tokenizers": tokenizers.__version__, "pyarrow": pyarrow.__version__},
        }
    )


def _prepare_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir}: exists and is not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out_dir}: cannot create ({e.strerror or e})") from None


def _make_executor(executor: str | Executor) -> Executor:
    if executor == "ray":
        return RayDataExecutor()
    if executor == "local":
        return LocalExecutor()
    if isinstance(executor, str):
        raise ValueError(f"unknown executor {executor!r}")
    return executor


# --------------------------------------------------------------------------- phases


def _train_tokenizer(
    ex: Executor, units: list[WorkUnit], inputs: _Inputs, progress: ProgressFn | None
) -> bytes:
    """Train on the cleaned documents whose hash falls in the sampled fraction, each
    distinct text once, in dedup order: the same inputs give the same tokenizer."""
    training = inputs.training
    assert training is not None
    fraction = min(1.0, training.sample_mb * MB / max(1, inputs.total_bytes))
    seen: set[str] = set()
    texts: list[str] = []
    stream = ex.map_units(units, SampleStage, {"fraction": fraction})
    for table in _with_progress(stream, units, "sample", progress):
        for doc_id, text in zip(
            table.column("doc_id").to_pylist(), table.column("text").to_pylist(), strict=True
        ):
            if doc_id not in seen:
                seen.add(doc_id)
                texts.append(text)
    if not texts:
        raise UserError(
            "no usable document to train the tokenizer on: every record was "
            "rejected (see the sources' cleaning settings)"
        )
    return train_bpe(texts, training, inputs.spec.eos_token)


def _tokenize_and_write(
    ex: Executor,
    units: list[WorkUnit],
    inputs: _Inputs,
    tokenizer_json: bytes,
    info: TokenizerInfo,
    out_dir: Path,
    progress: ProgressFn | None,
) -> tuple[dict[str, SourceAccount], dict[str, float]]:
    """The main pass; returns the accounts and where the time went: CPU seconds of
    the workers' stages, and this process's own dedup+write seconds (the rest of
    the pass it waits for the pipeline)."""
    writer = DatasetWriter(
        out_dir, [s.name for s in inputs.sources], info.dtype, int(inputs.spec.shard_target_mb * MB)
    )
    stage_kwargs = {
        "tokenizer_json": tokenizer_json.decode("utf-8"),
        "eos_id": info.eos_id,
        "dtype": info.dtype,
        "threads": ex.tokenizer_threads,
    }
    spent = dict.fromkeys(("cpu_read_clean", "cpu_tokenize", "dedup_write_in_driver"), 0.0)
    for table in _with_progress(
        ex.map_units(units, TokenizeStage, stage_kwargs), units, "tokenize", progress
    ):
        t = time.perf_counter()
        writer.add(table)
        spent["dedup_write_in_driver"] += time.perf_counter() - t
        for column in ("cpu_read_clean", "cpu_tokenize"):
            spent[column] += float(table.column(column).to_numpy().sum())
    t = time.perf_counter()
    accounts = writer.finish()
    spent["dedup_write_in_driver"] += time.perf_counter() - t
    return accounts, spent


def _with_progress(
    tables: Iterable[pa.Table], units: list[WorkUnit], phase: str, progress: ProgressFn | None
) -> Iterable[pa.Table]:
    total = sum(u.nbytes for u in units)
    done_units: set[int] = set()
    done = 0
    if progress:
        progress(phase, 0, total)
    for table in tables:
        if progress and "unit" in table.column_names:
            for u in set(table.column("unit").to_pylist()) - done_units:
                done_units.add(u)
                done += units[u].nbytes
            progress(phase, done, total)
        yield table
    if progress:
        progress(phase, total, total)


def _remove_stale_files(out_dir: Path, manifest: dict, old_manifest: dict | None) -> None:
    """Shards no manifest lists any more (an earlier, bigger build), and temporary
    files a killed run left behind."""
    keep = listed_files(manifest)
    names = set(manifest["sources"]) | {f.split("/")[0] for f in listed_files(old_manifest)}
    for name in sorted(n for n in names if re.match(SOURCE_NAME_PATTERN, n)):
        folder = out_dir / name
        if not folder.is_dir():
            continue
        for p in [*folder.glob("part-*.parquet"), *folder.glob(".part-*.tmp-*")]:
            if f"{name}/{p.name}" not in keep:
                p.unlink(missing_ok=True)
        if not any(folder.iterdir()):
            folder.rmdir()
    for p in out_dir.glob(".*.tmp-*"):
        p.unlink(missing_ok=True)
