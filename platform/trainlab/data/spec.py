"""`DataSpec`: everything a training worker needs to rebuild the stream, checked
once on the driver by `prepare_run_data(cfg)` before any training starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trainlab.data.corpus import read_doc_index, validation_split
from trainlab.data.manifest import load_manifest, resolve_dataset_dir, verify_shards
from trainlab.data.mix import check_repetition_cap, normalize_mix
from trainlab.errors import UserError


@dataclass(frozen=True)
class DataSpec:
    """Small and picklable: sent to every Ray Train worker.

    The stream is a pure function of (fingerprint, sources+weights, seed, seq_len,
    global_batch_size) and the step."""

    path: str  # absolute dataset directory
    fingerprint: str
    sources: tuple[str, ...]  # mixed sources, manifest order
    weights: tuple[float, ...]  # normalized token shares, same order
    train_tokens: tuple[int, ...]  # tokens per source after the validation hold-out
    val_tokens: tuple[int, ...]
    seed: int
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    total_steps: int
    val_fraction: float
    max_epochs_per_source: float
    eos_id: int
    vocab_size: int
    loader_cpus: float
    allow_fingerprint_change: bool
    # Epochs each source needs for total_steps (checked against the cap).
    epochs_needed: tuple[float, ...]
    all_sources: tuple[str, ...] = ()  # every source in the manifest (validation may use any)
    ray_data_metrics: bool = False  # push Ray Data's dataset metrics (not part of the stream)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def stream_identity(self) -> dict[str, Any]:
        """What fixes the sequence order (besides the step)."""
        return {
            "fingerprint": self.fingerprint,
            "sources": list(self.sources),
            "weights": list(self.weights),
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "val_fraction": self.val_fraction,
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _split_token_counts(manifest: Any, source: str, val_fraction: float) -> tuple[int, int]:
    ids, lengths = read_doc_index(manifest, source)
    train, val = validation_split(ids, val_fraction)
    return int(lengths[train].sum()), int(lengths[val].sum())


def prepare_run_data(cfg: Any, check_checksums: bool = True) -> DataSpec:
    """Check the prepared dataset and the mix for `cfg` (an ExperimentConfig) and
    return the DataSpec. Raises UserError (before any training) when the dataset is
    missing or corrupt, a mixed source does not exist or has no training data, the
    vocabulary does not fit the model, or the mix needs more repetition of a source
    than data.max_epochs_per_source allows for train.total_steps."""
    d = cfg.data
    root = resolve_dataset_dir(d.path)
    manifest = load_manifest(root)
    verify_shards(manifest, checksums=check_checksums)
    if manifest.vocab_size > cfg.model.vocab_size:
        raise UserError(
            f"model.vocab_size = {cfg.model.vocab_size}: smaller than the prepared "
            f"dataset's tokenizer vocabulary ({manifest.vocab_size}, {root})"
        )
    counts = {
        name: _split_token_counts(manifest, name, d.val_fraction) for name in manifest.sources
    }
    weights = normalize_mix(d.mix, {n: c[0] for n, c in counts.items()})
    names = tuple(weights)
    global_batch = cfg.global_batch_size
    train_tokens = tuple(counts[n][0] for n in names)
    needed = check_repetition_cap(
        names,
        [weights[n] for n in names],
        train_tokens,
        d.seq_len,
        cfg.train.total_steps * global_batch,
        d.max_epochs_per_source,
        cfg.train.total_steps,
    )
    return DataSpec(
        path=str(root),
        fingerprint=manifest.fingerprint,
        sources=names,
        weights=tuple(weights[n] for n in names),
        train_tokens=train_tokens,
        val_tokens=tuple(counts[n][1] for n in names),
        seed=d.seed,
        seq_len=d.seq_len,
        micro_batch_size=d.micro_batch_size,
        grad_accum_steps=d.grad_accum_steps,
        global_batch_size=global_batch,
        total_steps=cfg.train.total_steps,
        val_fraction=d.val_fraction,
        max_epochs_per_source=d.max_epochs_per_source,
        eos_id=manifest.eos_id,
        vocab_size=manifest.vocab_size,
        loader_cpus=d.loader_cpus,
        allow_fingerprint_change=d.allow_fingerprint_change,
        epochs_needed=tuple(round(float(needed[n]), 6) for n in names),
        all_sources=tuple(manifest.sources),
        ray_data_metrics=d.ray_data_metrics,
    )


def rows_per_rank(spec: DataSpec, world_size: int) -> int:
    """Rows of each global batch one rank gets; checks the topology fits the batch."""
    g = spec.global_batch_size
    if world_size < 1 or g % world_size or (g // world_size) % spec.micro_batch_size:
        raise UserError(
            f"data: global batch {g} cannot be split into {world_size} equal "
            f"slices of whole micro batches of {spec.micro_batch_size} rows"
        )
    return g // world_size
