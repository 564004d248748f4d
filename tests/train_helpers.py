"""Helpers for training tests: tiny configs over a real prepared dataset.

The dataset is `devtools.datasets.small_dataset` (standard-library source
and docstrings, a BPE tokenizer trained on them, the contract-2 format),
shared with the data tests through pytest's base temp dir; the stream is the
real `trainlab.data.WorkerLoader`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from devtools.datasets import small_dataset
from trainlab.config import ExperimentConfig
from trainlab.data import WorkerLoader
from trainlab.train.job import TrainJob, in_process_job
from trainlab.train.loop.callbacks import RunContext

TINY: dict[str, Any] = {
    "name": "unit",
    "purpose": "test",  # a real run (not --smoke) needs both
    "expectation": "it trains",
    "model": {
        "arch": "llama",
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_hidden_size": 64,
        "vocab_size": 1024,
        "max_seq_len": 64,
    },
    "data": {
        "seq_len": 32,
        "micro_batch_size": 4,
        "mix": {"code": 0.7, "docs": 0.3},
        "val_fraction": 0.1,
        "loader_cpus": 0.5,
    },
    "train": {
        "lr": 3e-3,
        "warmup_steps": 2,
        "total_steps": 12,
        "log_interval": 2,
        "eval_interval": 4,
        "eval_batches": 1,
        "deterministic": True,
        "checkpoint": {"every_steps": 4, "keep_last": 2, "keep_best": 1},
    },
    "parallel": {"strategy": "ddp"},
    "resource": {"num_workers": 1},
}


def dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small real dataset, written once per session (shared with the data tests)."""
    return small_dataset(tmp_path_factory.getbasetemp() / "small-ds")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tiny_config(dataset: Path, **sections: Any) -> ExperimentConfig:
    """TINY over `dataset`, with sections merged key by key (e.g. train={"total_steps": 4})."""
    raw = _merge(TINY, {"data": {"path": str(dataset)}})
    return ExperimentConfig.model_validate(_merge(raw, sections))


def make_job(cfg: ExperimentConfig, run_dir: Path) -> TrainJob:
    """What the launcher would hand a worker, for driving the loop in one process."""
    return in_process_job(cfg, run_dir, "test")


def local_loader(job: TrainJob) -> WorkerLoader:
    return WorkerLoader(job.data_spec, 0, 1, backend="local")


def new_run_context(cfg: ExperimentConfig, run_dir: str | Path) -> RunContext:
    """The RunContext of a fresh run (step 0, no restarts) for driving callbacks
    directly, without a plan, dataset or manifest behind it."""
    return RunContext(
        cfg=cfg,
        plan={},
        run_dir=str(run_dir),
        config_hash="h",
        dataset_fingerprint="f",
        manifest_path="",
        start_step=0,
        restarts=0,
    )
