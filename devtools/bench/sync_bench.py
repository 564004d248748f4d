"""`host_syncs_per_step`: the tensor-to-host reads of one training step of the tiny
recipe that neither logs, evaluates nor checkpoints (1 process, the real Trainer):
target 0. Counted as torch counts them, `aten._local_scalar_dense` (what
`.item()`, `float()` and `bool()` of a tensor dispatch to; each is a
device-to-host sync on a GPU) under a `TorchDispatchMode`.

Baseline, measured in the same run: the reads of a logging step's whole loop
iteration (the step, its signals, the previous step's signals read, the
window's metrics), where reading is the point."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from devtools.bench import BenchResult


def host_reads_counter() -> Any:
    """A TorchDispatchMode counting the tensor-to-Python reads (device-to-host syncs
    on a GPU); `.count` after the `with` block (tests/unit/train/test_host_sync.py too)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func is torch.ops.aten._local_scalar_dense.default:
                self.count += 1
            return func(*args, **(kwargs or {}))

    return HostReads()


def tiny_recipe(dataset: Path, runs: Path) -> Any:
    """trainers/recipes/tiny.yaml on the small dataset, one process, logging every
    other step, no evaluation or checkpoint in the steps measured."""
    from trainlab.config import load_config

    repo = Path(__file__).resolve().parents[2]
    return load_config(
        repo / "trainers" / "recipes" / "tiny.yaml",
        [
            f"data.path={dataset}",
            "data.mix={code: 0.7, docs: 0.3}",
            "model.vocab_size=1024",
            "resource.num_workers=1",
            "train.log_interval=2",
            f"train.runs_root={runs}",
        ],
    )


def host_reads(cfg: Any, run_dir: Path) -> tuple[int, int]:
    """(reads of quiet step 3, reads of the loop iteration of logging step 4)."""
    import torch

    from trainlab.data import WorkerLoader
    from trainlab.train.job import in_process_job
    from trainlab.train.loop.metrics import launch
    from trainlab.train.loop.trainer import Trainer
    from trainlab.train.parallel.distributed import DistEnv

    torch.manual_seed(0)
    job = in_process_job(cfg, run_dir, "bench")
    trainer = Trainer(job, WorkerLoader(job.data_spec, 0, 1, backend="local"), DistEnv())
    trainer._start()
    stream = trainer.loader.iter_from(0)
    trainer._advance(stream)  # step 1: set-up
    trainer._advance(stream)  # step 2
    step, batches = next(stream)
    quiet = host_reads_counter()
    with quiet:
        loss, norm = trainer.train_step(batches)
        launch(trainer.env, trainer.step, loss, norm, 0.0, 0.0)
    logging = host_reads_counter()
    with logging:
        trainer._advance(stream)  # step 4: logs
    return quiet.count, logging.count


def bench_host_syncs_per_step() -> list[BenchResult]:
    from devtools.datasets import small_dataset

    with tempfile.TemporaryDirectory(prefix="trainlab-bench-") as tmp:
        root = Path(tmp)
        cfg = tiny_recipe(small_dataset(root / "dataset"), root / "runs")
        quiet, logging = host_reads(cfg, root / "run")
    return [
        BenchResult(
            "host_syncs_per_step",
            float(quiet),
            "reads",
            "logging_step_reads",
            float(logging),
            ratio=quiet / logging if logging else 0.0,
            notes={
                "target": "0 (lower is better)",
                "what": "aten._local_scalar_dense under a TorchDispatchMode: a quiet step "
                "(train_step + its signals' launch) of the tiny recipe, 1 process",
                "baseline": "the whole loop iteration of a logging step",
            },
        )
    ]
