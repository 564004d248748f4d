"""The training state in and out of checkpoints (the disk protocol itself,
commits, is trainlab.train.checkpoint; validation records and retention,
trainlab.run.checkpoints).

One format for every layout and world size, torch.distributed.checkpoint
(DCP). A checkpoint of step s holds the parts of `TrainState`:

    trainer.pt        rank 0: the header (step, format, identity, layout, latest
                      evaluation), the data position and the grad scaler
    rng-rank{r}.pt    every rank: its random generators
    state/            DCP: {"model", "optimizer"} by the whole model's parameter
                      names, each rank writing its own entries (a replicated
                      tensor once), so any layout reads any other's

and checkpoint.json, whose fields start from the same header.

A checkpoint of another format is refused before anything is loaded
(trainlab.run.checkpoints.foreign_config names it).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from trainlab.config.dims import ParallelDims
from trainlab.config.schema import ExperimentConfig, ModelConfig
from trainlab.run import checkpoints as ckpts
from trainlab.train import checkpoint as ck
from trainlab.train.job import TrainJob
from trainlab.train.loop.rng import seed_everything
from trainlab.train.loop.state import TrainState, fresh_cpu_model
from trainlab.train.loop.step import Batch, loss_sum_and_count, to_tensors
from trainlab.train.parallel.distributed import DistEnv

log = logging.getLogger("trainlab.train")
# DCP warns on every call without a process group that it assumes one process:
# that is what trainlab means when it passes no_dist (one process, validation).
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is .*assuming the intent is to", category=UserWarning
)

TRAINER_FILE = "trainer.pt"
DCP_DIR = "state"
FORMAT = ckpts.FORMAT


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


class Checkpointer:
    """Saves and restores one rank's `TrainState` (every rank calls every method
    at the same steps: the formats use collectives)."""

    def __init__(self, job: TrainJob, env: DistEnv, state: TrainState):
        self.job, self.env, self.state = job, env, state
        self.cfg: ExperimentConfig = job.cfg
        c = self.cfg.train.checkpoint
        # The run's checkpoints: its directory's, or its object store's (read
        # through this node's verified cache); one restore path for both.
        self.catalog = ckpts.catalog(job.location)
        self.writer = ck.CheckpointWriter(
            job.checkpoint_root,
            env.rank,
            env.world_size,
            c.keep_last,
            c.keep_best,
            c.async_save,
            catalog=self.catalog,
            orphaned=job.orphaned if env.rank == 0 else None,
        )
        self.validation_batch: Batch | None = None  # rank 0, set before the first save
        # P0 rollbacks so far ({from_step, to_step, skipped, rule}): saved in every
        # checkpoint's header so a resumed run skips the same windows.
        self.rollbacks: list[dict[str, Any]] = []
        self._async_group: Any = None
        self._stager: Any = None  # async saves' host buffers, kept from one save to the next

    # ------------------------------------------------------------------ saving

    def header(self) -> dict[str, Any]:
        """What trainer.pt and checkpoint.json both say about the checkpoint."""
        return {
            **self.state.progress.state_dict(),
            "format": FORMAT,
            "config_hash": self.job.config_hash,
            "dataset_fingerprint": self.job.dataset_fingerprint,
            "world_size": self.env.world_size,
            "strategy": self.cfg.parallel.strategy,
            "layout": layout_of(self.cfg),
            "rollbacks": [dict(r) for r in self.rollbacks],
        }

    def _save(self, step: int, evaluated: bool) -> None:
        background = self.cfg.train.checkpoint.async_save  # training mutates live tensors
        header = self.header()
        scaler = self.state.model.scaler
        trainer_state = {
            **header,
            "data": self.state.data.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
        rng = self.state.rng.state_dict()
        rank = self.env.rank
        # The previous save first: its fault (async) must surface before this save
        # begins, whose DCP writer would otherwise write on after the cleanup.
        self.writer.wait()
        write_model = self._stage_model(step, background)

        def write_files(staging: Path) -> None:
            write_model(staging)
            ck.save_file(rng, staging / rng_file(rank))
            if rank == 0:
                ck.save_file(trainer_state, staging / TRAINER_FILE)

        validator = None
        if self.env.is_main and self.cfg.train.checkpoint.validate:
            if self.state.model.sharded:  # never held whole: read a tensor at a time
                validator = partial(
                    validate_sharded_checkpoint,
                    m=self.cfg.model,
                    val_loss=header["val_losses"].get("all"),
                )
            else:  # the model fits one device: load it whole and run a forward
                validator = partial(
                    validate_checkpoint, m=self.cfg.model, batch=self.validation_batch
                )
        # keep_best ranks by val_loss: the held-out evaluation of this step, the number
        # reported as val_loss everywhere (none between evaluations). The fixed-batch
        # loss of validation is recorded apart, as validation_loss.
        meta = {**header, "val_loss": header["val_losses"].get("all") if evaluated else None}
        self.writer.submit(step, write_files, meta, validator)

    def save(self, evaluated: bool = True) -> None:
        """Every rank writes its part of the checkpoint of the current step; rank 0
        commits it (in the background with train.checkpoint.async_save).
        `evaluated`: the latest evaluation is of this step (else no val_loss).
        A write the disk fails (full, I/O error) raises `ck.StorageFault`, its
        partial checkpoint removed."""
        step = self.state.progress.step
        try:
            self._save(step, evaluated)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException too
            fault = self.writer.fault(step, e)
            if fault is e:
                raise
            raise fault from e

    def _stage_model(self, step: int, background: bool) -> Callable[[Path], None]:
        """Take the model and optimizer state now (DCP, every rank its entries);
        return what finishes writing it. In the background, DCP's async save
        stages the state to host memory first, then writes while training goes on."""
        import torch.distributed as dist

        state = self.state.model.state_dict()
        target = str(self.writer.staging_dir(step) / DCP_DIR)
        group = None
        if background and self.env.distributed:
            if self._async_group is None:  # async collectives get their own group
                self._async_group = dist.new_group(backend="gloo")
            group = self._async_group
        if background and self._stager is None:
            self._stager = host_stager()
        return begin_save(
            state, target, background, not self.env.distributed, group, self._stager
        )

    def close(self) -> None:
        """Free the staging buffers of async saves (after the last one)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def completed(self) -> list[ckpts.CheckpointInfo]:
        """Checkpoints committed since the last call (rank 0)."""
        return self.writer.completed()

    def wait(self) -> None:
        self.writer.wait()

    # ------------------------------------------------------------------ restoring

    def restore(self) -> ckpts.CheckpointInfo | None:
        """Load the newest valid checkpoint into the state; None when there is none.
        Rank 0 picks it: in a directory, the newest valid and intact one; in object
        storage, the newest whose files all arrive intact (fetched into its node's
        cache and checked). Every other rank then reads the same one where its node
        has it (the run's folder, or its node's cache: a verified copy is reused)."""
        t0 = time.perf_counter()
        catalog = self.catalog
        chosen: dict[str, Any] | None = None
        if self.env.is_main:
            ckpts.clean_staging(catalog.local_root)  # leftovers of a crashed attempt
            catalog.clean_uncommitted()
            info = catalog.fetch_newest(require_valid=self.cfg.train.checkpoint.validate)
            chosen = {"step": info.step, "meta": info.meta} if info else None
        chosen = self.env.broadcast_object(chosen)
        if chosen is None:
            return None
        step = int(chosen["step"])
        info = catalog.fetch(
            ckpts.CheckpointInfo(catalog.local_root, step, chosen["meta"], catalog.uri(step))
        )
        fetched = time.perf_counter() - t0
        self.load(info.path)
        log.info(
            "resumed from %s (step %d): found in %.2f s, loaded in %.2f s",
            info.uri or info.path,
            self.state.progress.step,
            fetched,
            time.perf_counter() - t0 - fetched,
        )
        return info

    def load_info(self, info: ckpts.CheckpointInfo) -> None:
        """Load checkpoint `info` (chosen by rank 0, the same on every rank) where
        this node has it: its directory, or for a run in object storage this node's
        verified copy (fetched first when the node has none)."""
        self.load(self.catalog.fetch(info).path)

    def load(self, path: Path) -> None:
        trainer_state = ck.load_file(path / TRAINER_FILE)
        info = ckpts.CheckpointInfo(path, int(trainer_state["step"]), trainer_state)
        problem = ckpts.foreign_config(info, self.job.config_hash)
        if problem:
            raise RuntimeError(problem)
        model = self.state.model
        saved_layout, layout = trainer_state.get("layout"), layout_of(self.cfg)
        if saved_layout is not None and saved_layout != layout:
            log.warning(
                "checkpoint %s was saved at layout %s; resharding it to %s",
                path,
                _describe(saved_layout),
                _describe(layout),
            )
        import torch.distributed.checkpoint as dcp

        state = model.state_dict()
        dcp.load(state, checkpoint_id=str(path / DCP_DIR), no_dist=not self.env.distributed)
        model.load_state_dict(state)
        if model.scaler is not None and trainer_state.get("scaler"):
            model.scaler.load_state_dict(trainer_state["scaler"])
        self.state.data.load_state_dict(trainer_state["data"])
        self.state.progress.load_state_dict(trainer_state)
        self.rollbacks = [dict(r) for r in trainer_state.get("rollbacks") or []]
        rng = path / rng_file(self.env.rank)
        if rng.exists():
            self.state.rng.load_state_dict(ck.load_file(rng))
        else:  # the world size changed: no saved stream for this rank
            log.warning(
                "checkpoint %s has no RNG state for rank %d; reseeding", path, self.env.rank
            )
            step = self.state.progress.step
            seed_everything(self.cfg.train.seed + 1 + self.env.rank + 7919 * step)


def host_stager() -> Any:
    """DCP's stager for async saves, kept across saves so its host buffers are
    allocated once: the step then blocks only for the device-to-host copy
    (pinned memory and non-blocking copies on CUDA; a plain copy on CPU). The
    write runs in DCP's background thread (`begin_save`)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = torch.cuda.is_available()
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
    )


def begin_save(
    state: dict[str, Any],
    target: str,
    background: bool,
    no_dist: bool,
    group: Any = None,
    stager: Any = None,
) -> Callable[[Path], None]:
    """Start a DCP save of `state` into `target`; returns what finishes it. Inline
    it writes now; in the background it returns once `stager` holds a host copy
    (the only time the training loop waits) and writes in DCP's thread."""
    import torch.distributed.checkpoint as dcp

    if not background:
        dcp.save(state, checkpoint_id=target, no_dist=no_dist)
        return lambda staging: None
    future = dcp.async_save(
        state, checkpoint_id=target, process_group=group, no_dist=no_dist, async_stager=stager
    )
    return lambda staging: future.result()


def layout_of(cfg: ExperimentConfig) -> dict[str, Any]:
    """What a checkpoint (and each attempt) records of the layout that wrote it. The
    expert-parallel degree only where it is above 1: a checkpoint of a run without
    expert parallelism keeps the record it had before `parallel.ep` existed, so its
    resume is not taken for a reshard."""
    dims, p = ParallelDims.of(cfg), cfg.parallel
    layout: dict[str, Any] = {**dims.degrees, "strategy": p.strategy, "zero_stage": p.zero_stage}
    if (p.ep or 1) > 1:
        layout["ep"] = p.ep
    return layout


def _describe(layout: dict[str, Any]) -> str:
    keys = ("tp", "pp", "dp", "strategy", "zero_stage")
    return " ".join(f"{k}={layout.get(k)}" for k in keys) + f" ep={layout.get('ep', 1)}"


# --------------------------------------------------------------------------- validation


def load_weights_on_cpu(path: Path, cfg: ExperimentConfig | ModelConfig) -> Any:
    """A fresh CPU model (eval mode) holding the weights of checkpoint directory
    `path`, whatever layout wrote it."""
    import torch.distributed.checkpoint as dcp

    model_cfg = cfg.model if isinstance(cfg, ExperimentConfig) else cfg
    model = fresh_cpu_model(model_cfg)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path / DCP_DIR), no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval()


def validate_checkpoint(path: Path, m: ModelConfig, batch: Batch) -> ckpts.Validation:
    """Load into a fresh CPU model and run one forward on a fixed batch: valid when
    it loads and the loss is finite."""
    model = load_weights_on_cpu(path, m)
    with torch.no_grad():
        total, count = loss_sum_and_count(model, to_tensors(batch, torch.device("cpu")))
    loss = (total / count.clamp(min=1)).item()
    if not math.isfinite(loss):
        return ckpts.Validation(ok=False, loss=None, error=f"validation loss is {loss}")
    return ckpts.Validation(ok=True, loss=loss)


def validate_sharded_checkpoint(
    path: Path, m: ModelConfig, val_loss: float | None
) -> ckpts.Validation:
    """A sharded (dcp) checkpoint, checked without ever holding the model: every
    parameter of the model is there with its shape, and finite, read one tensor at
    a time (host memory: the largest tensor). Its loss is the latest evaluation's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    expected = {k: tuple(v.shape) for k, v in fresh_meta_state(m).items()}
    reader = dcp.FileSystemReader(str(path / DCP_DIR))
    stored = reader.read_metadata().state_dict_metadata
    for key, shape in expected.items():
        meta = stored.get(f"model.{key}")
        if not isinstance(meta, TensorStorageMetadata):
            return ckpts.Validation(ok=False, loss=None, error=f"model.{key} is missing")
        if tuple(meta.size) != shape:
            return ckpts.Validation(
                ok=False, loss=None, error=f"model.{key} has shape {tuple(meta.size)}, not {shape}"
            )
        tensor = torch.empty(shape, dtype=meta.properties.dtype)
        dcp.load({"model": {key: tensor}}, storage_reader=reader, no_dist=True)
        if not bool(torch.isfinite(tensor).all()):
            return ckpts.Validation(
                ok=False, loss=None, error=f"model.{key} holds non-finite values"
            )
        del tensor
    if val_loss is not None and not math.isfinite(val_loss):
        return ckpts.Validation(ok=False, loss=None, error=f"the latest val_loss is {val_loss}")
    return ckpts.Validation(ok=True, loss=val_loss)


def fresh_meta_state(m: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's state dict on the meta device (names and shapes, no memory)."""
    from trainlab.models import build_model

    with torch.device("meta"):
        return build_model(m).state_dict()
