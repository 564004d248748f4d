"""`run_prep`: sources file in, prepared dataset directory out (contract 2).

    check everything (sources file, paths, tokenizer, output dir)   -> UserError, no work
    up to date?  (same inputs and settings, every file intact)      -> return at once
    [train the tokenizer on a hash-sampled slice of the cleaned text]
    units:  read -> clean -> hash -> tokenize -> dedup keys   (workers; recorded)
    dedup:  hash-partitioned shuffle of the keys             (workers)
    settle: final reasons, accounts, kept rows per unit      (workers)
    write:  one shard per work item                          (workers)
    manifest.json last, atomically                           (this process)

The driver sends paths and receives counts and file lists: no document data
passes through it (except the tokenizer-training sample, when one is trained),
so its memory does not grow with the corpus. Workers read and write the output
directory directly, so on a multi-node cluster it must be shared storage.

Resumable: each unit's result is recorded in `DIR/.prep-work/` as it finishes,
under a key of its inputs and settings (`work`). A killed run (SIGKILL
included) leaves no manifest (the old one is removed before anything is
overwritten); the next run with the same inputs reuses every recorded unit and
redoes the rest, and a changed input invalidates only the units it touches.
The work directory, stale shards and temporary files are swept at the end.

`--out s3://bucket/prefix` (object storage, no shared filesystem needed): the
dataset is built in a staging directory under this node's scratch area
(`trainlab.nodedisk.scratch_root()`, one per output location, so a killed run's
finished units are reused by the next), by workers on this node only, then
uploaded: the store's old manifest is deleted before anything else is written,
the tokenizer and shards go up next, shards no new manifest lists are deleted,
and manifest.json goes up last. A run that fails or is killed at any point
leaves the location without a manifest, so nothing takes it for a dataset.
"""

from __future__ import annotations

import hashlib
import json
import re
import resource
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from trainlab.data.prep.cleaning import CLEANING_RULES, CLEANING_RULES_VERSION
from trainlab.data.prep.dedup import lsh_bands, partition_bounds
from trainlab.data.prep.executors import LocalExecutor, RayDataExecutor, Received
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
from trainlab.data.prep.shards import SHARD_NAME, SourceAccount, atomic_write_bytes
from trainlab.data.prep.spec import (
    SOURCE_NAME_PATTERN,
    SourcesFile,
    TokenizerTraining,
    choose_tokenizer,
    load_sources_file,
    resolve_root,
)
from trainlab.data.prep.stages import (
    reduce_stage,
    sample_stage,
    settle_stage,
    train_stage,
    unit_stage,
    write_stage,
)
from trainlab.data.prep.tokenizer import (
    TokenizerInfo,
    describe,
    read_tokenizer_file,
    sha256_bytes,
)
from trainlab.data.prep.units import SourceFiles, WorkUnit, plan_units
from trainlab.data.prep.units import unit_target_bytes as default_unit_bytes
from trainlab.data.prep.work import WORK_DIR, WorkDir
from trainlab.errors import UserError, first_line
from trainlab.location import Location, StorageError, locate

MB = 1 << 20
TOKENIZER_FILE = "tokenizer.json"
# Input bytes whose dedup keys one partition of the shuffle holds at most (with
# near dedup, about 0.5 KB of keys per document: 256 MB of 10 KB documents is
# ~13 MB of keys; of 100-byte documents, ~1.3 GB).
PARTITION_INPUT_BYTES = 256 * MB

# (phase, bytes of raw input done, bytes in total); phases: "sample", "tokenize".
ProgressFn = Callable[[str, int, int], None]


class Executor(Protocol):
    parallelism: int
    tokenizer_threads: bool
    received: Received

    def map_items(
        self,
        items: list[dict[str, Any]],
        stage: Callable,
        kwargs: dict[str, Any],
        blocks: str = "guided",
        scratch: str | None = None,
    ) -> Iterable[pa.Table]: ...


@dataclass
class PrepResult:
    out_dir: Path | str  # a local directory, or the s3:// URI it was uploaded to
    manifest: dict
    up_to_date: bool
    seconds: float
    # Wall seconds per phase: check, train_tokenizer, tokenize_write (of which
    # stage_units_s, stage_dedup_s, stage_settle_s, stage_write_s), finish; CPU
    # seconds the workers spent in cpu_read_clean, cpu_tokenize, cpu_dedup_keys;
    # per stage X, how busy it kept the workers (busy_X_s, busy_share_X, first_X_s,
    # tail_idle_X_s; see `executors.Received.utilisation`).
    timings: dict[str, float] = field(default_factory=dict)
    units_total: int = 0
    units_reused: int = 0
    # Ray nodes whose workers prepared the units this run did (0: all reused).
    unit_nodes: int = 0
    # Peak resident memory of this process (the driver) so far (`peak_rss_bytes`).
    driver_peak_rss_bytes: int = 0
    # What the executor handed to this process: all bytes, and those of document data.
    driver_received_bytes: int = 0
    driver_document_bytes: int = 0

    def summary(self) -> dict[str, Any]:
        """The numbers `trainlab prep --json` reports beside the manifest."""
        return {
            "up_to_date": self.up_to_date,
            "seconds": round(self.seconds, 3),
            "units_total": self.units_total,
            "units_reused": self.units_reused,
            "unit_nodes": self.unit_nodes,
            "driver_peak_rss_bytes": self.driver_peak_rss_bytes,
            "driver_received_bytes": self.driver_received_bytes,
            "driver_document_bytes": self.driver_document_bytes,
            "driver_cpu_s": round(time.process_time(), 3),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
        }


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: VmHWM where Linux gives it (getrusage's
    ru_maxrss survives exec, so a child started by a big process would report its
    parent's), else ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    maxrss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return maxrss if sys.platform == "darwin" else maxrss * 1024


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
    on_checked: Callable[[], None] | None = None,
) -> PrepResult:
    """Prepare the dataset described by the sources file `sources` into `out`, a
    local directory or s3://bucket/prefix (see the module's docstring).

    `tokenizer` / `vocab_size` override the sources file's tokenizer choice.
    `executor`: "ray" (Ray Data on `trainlab.raycluster.ensure_ray()`), "local"
    (this process, no Ray), or an executor object. `unit_bytes` fixes the size of
    a work unit (default: from the corpus size and the parallelism).
    `on_checked` is called once the inputs passed their checks (the CLI says
    "starting" only then, so bad input stays one line).
    """
    t0 = time.perf_counter()
    store = _store_of(out)
    inputs = _check_inputs(Path(sources), tokenizer, vocab_size)
    if store is not None:
        _check_store(store)
        out_dir = _staging_dir(store)
    else:
        out_dir = Path(out)
        _refuse_users_folder(out_dir)
        _prepare_out_dir(out_dir)
    if on_checked is not None:
        on_checked()
    timings = {"check": time.perf_counter() - t0}
    existing = (
        current_manifest(out_dir, inputs.signature)
        if store is None
        else _current_in_store(store, inputs.signature)
    )
    if existing is not None:
        return PrepResult(
            out_dir if store is None else store.uri,
            existing,
            True,
            time.perf_counter() - t0,
            timings,
            driver_peak_rss_bytes=peak_rss_bytes(),
        )

    ex = _make_executor(executor, this_node_only=store is not None)
    units = plan_units(inputs.sources, unit_bytes or default_unit_bytes(inputs.total_bytes))
    old_manifest = read_manifest(out_dir)
    # From here on the directory is unfinished; its work folder says it is a dataset
    # being built (the next run completes it, `_refuse_users_folder`).
    (out_dir / WORK_DIR).mkdir(exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    if store is not None:
        old_manifest = _remove_store_manifest(store)

    t = time.perf_counter()
    tokenizer_json = inputs.tokenizer_json
    if tokenizer_json is None:
        assert inputs.training is not None
        tokenizer_json = _train_tokenizer(ex, units, inputs, out_dir, progress)
    info = describe(tokenizer_json, inputs.spec.eos_token, "trained tokenizer")
    atomic_write_bytes(out_dir / TOKENIZER_FILE, tokenizer_json)
    timings["train_tokenizer"] = time.perf_counter() - t

    t = time.perf_counter()
    accounts, spent, reused = _tokenize_and_write(
        ex, units, inputs, tokenizer_json, info, out_dir, progress
    )
    timings["tokenize_write"] = time.perf_counter() - t
    timings.update(spent)
    unit_nodes = int(timings.pop("unit_nodes"))

    t = time.perf_counter()
    doc = build_manifest(info, inputs.cleaning, accounts, inputs.signature)
    manifest = doc.to_json()
    if store is None:
        _remove_stale_files(out_dir, manifest, old_manifest)
        write_manifest(out_dir, doc)
        shutil.rmtree(out_dir / WORK_DIR, ignore_errors=True)
    else:
        timings["upload"] = _upload(out_dir, store, manifest, old_manifest)
        shutil.rmtree(out_dir, ignore_errors=True)  # the store holds the dataset now
    timings["finish"] = time.perf_counter() - t
    return PrepResult(
        out_dir if store is None else store.uri,
        manifest,
        False,
        time.perf_counter() - t0,
        timings,
        units_total=len(units),
        units_reused=reused,
        unit_nodes=unit_nodes,
        driver_peak_rss_bytes=peak_rss_bytes(),
        driver_received_bytes=ex.received.bytes,
        driver_document_bytes=ex.received.document_bytes,
    )


# --------------------------------------------------------------------------- object storage


def _store_of(out: str | Path) -> Location | None:
    """--out as object storage (s3://, gs://), or None for a local directory (a
    file:// URI is one too). Any other scheme is a UserError naming --out."""
    where = locate(out, what="--out")
    return None if where.is_local else where


def _check_store(store: Location) -> None:
    """The bucket exists and takes writes (a probe file), before any work. A bucket
    that does not exist is said as such, with how to create it (prep does not make
    buckets: who owns one, where and at what cost is the user's choice)."""
    try:
        store.check_writable()
    except UserError as e:
        if _no_bucket(e.lines[0]):
            raise UserError(f"--out {store.uri}: {missing_bucket(store)}") from None
        raise UserError(f"--out {store.uri}: {e.lines[0]}") from None


# How a store says that a write failed for want of its bucket: S3's error code
# (and its text), or "not there" for a new object (the probe), which can only be
# its bucket (GCS, trainlab.location's "absent" kind).
_NO_BUCKET_MARKS = ("no_such_bucket", "nosuchbucket", "bucket does not exist", ": not there")


def _no_bucket(message: str) -> bool:
    lowered = message.lower()
    return any(mark in lowered for mark in _NO_BUCKET_MARKS)


def missing_bucket(store: Location) -> str:
    """One line: the bucket of `store` does not exist, and how to create it."""
    scheme, _, rest = store.uri.partition("://")
    bucket = rest.split("/", 1)[0]
    where = f" ({store.describe()})" if store.describe() else ""
    create = (
        f"gcloud storage buckets create gs://{bucket}"
        if scheme == "gs"
        else f"aws s3 mb s3://{bucket}"  # the AWS CLI reads AWS_ENDPOINT_URL too
    )
    return (
        f"bucket {bucket!r} does not exist{where}; create it first (e.g. `{create}`, "
        "or your store's console), then run prep again (docs/storage.md)"
    )


def _staging_dir(store: Location) -> Path:
    """Where a dataset bound for `store` is built: this node's scratch area, one
    directory per location (a killed run's recorded units are found again)."""
    from trainlab.nodedisk import scratch_root

    key = hashlib.sha256(store.uri.encode()).hexdigest()[:16]
    staging = scratch_root() / "prep-staging" / key
    _prepare_out_dir(staging)
    return staging


def _current_in_store(store: Location, input_signature: str) -> dict | None:
    """The store's manifest if it was built from exactly these inputs and every file
    it lists is there (their checksums are verified where the dataset is read:
    `trainlab train`, `data inspect`); otherwise None (the dataset is rebuilt)."""
    from trainlab.data.manifest import parse_manifest

    try:
        raw = json.loads(store.read_bytes(MANIFEST).decode("utf-8"))
    except (FileNotFoundError, UnicodeDecodeError, ValueError):
        return None
    except StorageError as e:
        raise store.unreachable(MANIFEST, e) from None
    if not isinstance(raw, dict) or raw.get("input_signature") != input_signature:
        return None
    try:
        doc = parse_manifest(raw, store.uri_of(MANIFEST))
    except UserError:
        return None
    files = [doc.tokenizer.file] + [s.file for src in doc.sources.values() for s in src.shards]
    return doc.to_json() if all(store.is_file(f) for f in files) else None


def _remove_store_manifest(store: Location) -> dict | None:
    """Delete the store's manifest before anything there is overwritten; return it."""
    try:
        raw = json.loads(store.read_bytes(MANIFEST).decode("utf-8"))
    except (FileNotFoundError, UnicodeDecodeError, ValueError):
        raw = None
    except StorageError as e:
        raise store.unreachable(MANIFEST, e) from None
    try:
        store.delete(MANIFEST)
    except StorageError as e:
        raise store.unreachable(MANIFEST, e) from None
    return raw if isinstance(raw, dict) else None


UPLOAD_THREADS = 8


def _upload(staging: Path, store: Location, manifest: dict, old_manifest: dict | None) -> float:
    """Tokenizer and shards (in parallel), stale shards deleted, manifest.json last.
    Returns the seconds it took."""
    from concurrent.futures import ThreadPoolExecutor

    t = time.perf_counter()
    files = [manifest["tokenizer"].get("file", TOKENIZER_FILE), *sorted(listed_files(manifest))]
    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(pool.map(lambda rel: _upload_file(staging / rel, store, rel), files))
    _remove_stale_in_store(store, manifest, old_manifest)
    local = staging / MANIFEST
    atomic_write_bytes(local, (json.dumps(manifest, indent=2) + "\n").encode())
    _upload_file(local, store, MANIFEST)  # last: the dataset is complete
    return time.perf_counter() - t


def _upload_file(local: Path, store: Location, rel: str) -> None:
    """One file to the store, streamed (multipart for a big one: the object appears
    whole or not at all)."""
    try:
        store.upload(local, rel)
    except OSError as e:
        where = f" ({store.backend.describe()})" if store.backend.describe() else ""
        raise UserError(
            f"--out {store.uri_of(rel)}{where}: upload failed ({first_line(e)}); the "
            "location has no manifest; run the same command again"
        ) from None


def _remove_stale_in_store(store: Location, manifest: dict, old_manifest: dict | None) -> None:
    """Shards of the source folders that the new manifest does not list (an earlier,
    bigger build)."""
    keep = listed_files(manifest)
    names = set(manifest["sources"]) | {f.split("/")[0] for f in listed_files(old_manifest)}
    for name in sorted(n for n in names if re.match(SOURCE_NAME_PATTERN, n)):
        for base in store.list(name):
            if base.startswith("part-") and f"{name}/{base}" not in keep:
                store.delete(f"{name}/{base}")


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
        "dedup": spec.dedup.model_dump(),
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


def _refuse_users_folder(out_dir: Path) -> None:
    """--out must be new, empty or a trainlab dataset (a manifest.json that parses as
    one, or the work folder of an unfinished prep): prep overwrites tokenizer.json
    and manifest.json there, so a folder of the user's is refused, nothing written."""
    from trainlab.data.manifest import parse_manifest

    if not out_dir.is_dir():
        return  # new (or not a directory: `_prepare_out_dir` says so)
    try:
        if not any(out_dir.iterdir()) or (out_dir / WORK_DIR).is_dir():
            return
    except OSError as e:
        raise UserError(f"--out {out_dir}: cannot list ({e.strerror or e})") from None
    raw = read_manifest(out_dir)
    if raw is not None:
        try:
            parse_manifest(raw, str(out_dir / MANIFEST))
            return
        except UserError:
            pass
    raise UserError(
        f"--out {out_dir}: exists, is not empty and is not a trainlab dataset (no "
        "manifest.json of one); choose an empty or new directory"
    )


def _prepare_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir}: exists and is not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out_dir}: cannot create ({e.strerror or e})") from None


def _make_executor(executor: str | Executor, this_node_only: bool = False) -> Executor:
    if executor == "ray":
        return RayDataExecutor(this_node_only=this_node_only)
    if executor == "local":
        return LocalExecutor()
    if isinstance(executor, str):
        raise ValueError(f"unknown executor {executor!r}")
    return executor


# --------------------------------------------------------------------------- phases


def _train_tokenizer(
    ex: Executor, units: list[WorkUnit], inputs: _Inputs, out_dir: Path, progress: ProgressFn | None
) -> bytes:
    """Train on the cleaned documents whose hash falls in the sampled fraction, each
    distinct text once, in dedup order: the same inputs give the same tokenizer.
    Workers sample and train; this process reads the finished tokenizer file."""
    training = inputs.training
    assert training is not None
    work = WorkDir(out_dir)
    work.start_run()
    fraction = min(1.0, training.sample_mb * MB / max(1, inputs.total_bytes))
    items = [
        {"index": u.index, "unit": u.to_json(), "out": str(work.sample(u.index))} for u in units
    ]
    total, done = sum(u.nbytes for u in units), 0
    if progress:
        progress("sample", 0, total)
    for table in ex.map_items(items, sample_stage, {"fraction": fraction}):
        for index in table.column("index").to_pylist():
            done += units[index].nbytes
        if progress:
            progress("sample", done, total)
    train = {"index": 0, "samples": [i["out"] for i in items], "out": str(work.tokenizer())}
    kwargs = {"training": training.model_dump(), "eos_token": inputs.spec.eos_token}
    texts = sum(
        sum(t.column("texts").to_pylist()) for t in ex.map_items([train], train_stage, kwargs)
    )
    if not texts:
        raise UserError(
            "no usable document to train the tokenizer on: every record was "
            "rejected (see the sources' cleaning settings)"
        )
    return work.tokenizer().read_bytes()


def _tokenize_and_write(
    ex: Executor,
    units: list[WorkUnit],
    inputs: _Inputs,
    tokenizer_json: bytes,
    info: TokenizerInfo,
    out_dir: Path,
    progress: ProgressFn | None,
) -> tuple[dict[str, SourceAccount], dict[str, float], int]:
    """The main pass, in four distributed stages (see `stages`): units (reusing
    those a previous run recorded), the dedup shuffle, settling, shard writing.
    Returns the accounts, where the time went (CPU seconds of the workers'
    stages and wall seconds per stage) and how many units were reused."""
    work = WorkDir(out_dir)
    work.start_run()
    dedup = inputs.spec.dedup
    unit_key = work.unit_key_fn(
        tokenizer_sha256=info.sha256,
        eos_id=info.eos_id,
        dtype=info.dtype,
        dedup=dedup.model_dump(),
        bands=lsh_bands(dedup.near.threshold, dedup.near.num_perm) if dedup.near.enabled else None,
        cleaning_version=CLEANING_RULES_VERSION,
    )
    keys = [unit_key(u) for u in units]
    todo = [u for u, k in zip(units, keys, strict=True) if not work.unit_done(k)]
    reused = len(units) - len(todo)
    spent = dict.fromkeys(("cpu_read_clean", "cpu_tokenize", "cpu_dedup_keys"), 0.0)

    t = time.perf_counter()
    stage_kwargs = {
        "tokenizer_json": tokenizer_json.decode("utf-8"),
        "eos_id": info.eos_id,
        "dtype": info.dtype,
        "threads": ex.tokenizer_threads,
        "exact": dedup.exact,
        "near": dedup.near.model_dump(),
    }
    items = [
        {
            "unit": u.to_json(),
            "docs": str(work.docs(keys[u.index])),
            "keys": str(work.keys(keys[u.index])),
            "weight": u.nbytes,
        }
        for u in todo
    ]
    total = sum(u.nbytes for u in units)
    done = total - sum(u.nbytes for u in todo)
    if progress:
        progress("tokenize", done, total)
    nodes: set[str] = set()
    for table in ex.map_items(
        items, unit_stage, stage_kwargs, blocks="pull", scratch=str(work.run_dir)
    ):
        for row in table.to_pylist():
            nodes.add(row["node"])
            done += units[row["index"]].nbytes
            for column in spent:
                spent[column] += row[column]
        if progress:
            progress("tokenize", done, total)
    _stage_spent(spent, ex, "units", unit_stage, t)
    spent["unit_nodes"] = len(nodes)  # nodes whose workers did the units of this run

    t = time.perf_counter()
    loser_files = _dedup(
        ex, units, keys, work, dedup.near.threshold, dedup.exact or dedup.near.enabled
    )
    _stage_spent(spent, ex, "dedup", reduce_stage, t)

    t = time.perf_counter()
    settled = _settle(ex, units, keys, work, loser_files)
    _stage_spent(spent, ex, "settle", settle_stage, t)

    t = time.perf_counter()
    accounts = _write_shards(ex, units, keys, work, settled, inputs, info, out_dir)
    _stage_spent(spent, ex, "write", write_stage, t)
    return accounts, spent, reused


def _stage_spent(
    spent: dict[str, float], ex: Executor, name: str, stage: Callable, started: float
) -> None:
    """A stage's wall time `stage_X_s` (since `started`, a `time.perf_counter()`),
    and how busy it kept the workers (see `Received.utilisation`): `busy_X_s`,
    `busy_share_X`, `first_X_s`, `tail_idle_X_s`."""
    wall = time.perf_counter() - started
    end = time.time()
    spent[f"stage_{name}_s"] = wall
    use = ex.received.utilisation(stage.__name__, end - wall, end, ex.parallelism)
    spent[f"busy_{name}_s"] = use["busy_s"]
    spent[f"busy_share_{name}"] = use["busy_share"]
    spent[f"first_{name}_s"] = use["first_s"]
    spent[f"tail_idle_{name}_s"] = use["tail_idle_s"]


def _dedup(
    ex: Executor,
    units: list[WorkUnit],
    keys: list[str],
    work: WorkDir,
    threshold: float,
    enabled: bool,
) -> list[str]:
    """The hash-partitioned shuffle: each partition's owner writes its losers."""
    if not enabled:
        return []
    # One partition per worker, more where a partition would hold more than
    # PARTITION_INPUT_BYTES of input's keys (any n gives the same losers). Each
    # partition reads every unit's key file (their footers, at least), so more
    # partitions than needed cost reads, not balance: keys hash evenly.
    total = sum(u.nbytes for u in units)
    n = max(ex.parallelism, -(-total // PARTITION_INPUT_BYTES))
    unit_list = [[str(work.keys(keys[u.index])), u.source_index, u.file_offset] for u in units]
    items = [
        {"index": j, "lo": lo, "hi": hi, "units": unit_list, "out": str(work.losers(j))}
        for j, (lo, hi) in enumerate(partition_bounds(n))
    ]
    for _ in ex.map_items(items, reduce_stage, {"threshold": threshold}, blocks="even"):
        pass
    return [str(work.losers(j)) for j in range(n)]


def _settle(
    ex: Executor, units: list[WorkUnit], keys: list[str], work: WorkDir, loser_files: list[str]
) -> dict[int, dict]:
    items = [
        {
            "index": u.index,
            "docs": str(work.docs(keys[u.index])),
            "source_index": u.source_index,
            "file_offset": u.file_offset,
            "n_files": len(u.files),
            "losers": loser_files,
            "kept": str(work.kept(u.index)),
            "weight": u.nbytes,
        }
        for u in units
    ]
    settled: dict[int, dict] = {}
    for table in ex.map_items(items, settle_stage, {}, blocks="even"):
        for row in table.to_pylist():
            settled[row["index"]] = row
    return settled


def _write_shards(
    ex: Executor,
    units: list[WorkUnit],
    keys: list[str],
    work: WorkDir,
    settled: dict[int, dict],
    inputs: _Inputs,
    info: TokenizerInfo,
    out_dir: Path,
) -> dict[str, SourceAccount]:
    """Accounts from the per-unit summaries (in unit order, so examples are the
    first in dedup order); then one write item per shard, which the driver
    derives from the per-unit token totals alone."""
    accounts = {s.name: SourceAccount(s.name) for s in inputs.sources}
    itemsize = np.dtype(info.dtype).itemsize
    target = max(1, int(inputs.spec.shard_target_mb * MB))
    spans: dict[tuple[str, int], list] = {}
    running: dict[str, int] = dict.fromkeys(accounts, 0)
    for u in units:
        row = settled[u.index]
        acc = accounts[u.source]
        acc.merge(row["docs_in"], json.loads(row["rejected"]))
        start = running[u.source]
        running[u.source] += row["token_count"] * itemsize
        if row["docs_out"]:
            part = [str(work.docs(keys[u.index])), str(work.kept(u.index)), start]
            for k in range(start // target, (running[u.source] - 1) // target + 1):
                spans.setdefault((u.source, k), []).append(part)
    items = [
        {
            "index": i,
            "k": k,
            "target": target,
            "itemsize": itemsize,
            "parts": parts,
            "file": f"{source}/{SHARD_NAME.format(k)}",
            "out": str(out_dir / source / SHARD_NAME.format(k)),
            "weight": min(target, running[source] - k * target),  # about its bytes
        }
        for i, ((source, k), parts) in enumerate(spans.items())
    ]
    written = {}
    for table in ex.map_items(items, write_stage, {}, blocks="even"):
        for row in table.to_pylist():
            if row["file"] is not None:
                written[row["file"]] = row
    for item in items:  # in source order, then k
        row = written.get(item["file"])
        if row is not None:
            source = item["file"].split("/")[0]
            accounts[source].add_shard(out_dir, row)
    return accounts


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
