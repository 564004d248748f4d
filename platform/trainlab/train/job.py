"""What the driver hands every training worker: small, picklable, no torch.

The config arrives here validated and with its layout resolved, once: workers
read `job.cfg` as the typed `ExperimentConfig` and never validate it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainlab.config import ExperimentConfig


@dataclass(frozen=True)
class TrainJob:
    cfg: ExperimentConfig  # layout resolved (parallel.strategy in ddp/fsdp)
    plan: dict[str, Any]  # Plan.to_json()
    run_dir: str  # absolute
    config_hash: str
    dataset_fingerprint: str
    manifest_path: str  # absolute
    data_spec: Any  # trainlab.data.DataSpec
    sources: tuple[str, ...]  # source names, in manifest order
    session: str  # one `trainlab train` invocation; attempts of it share this id
    started_at: float  # driver's time.time() at launch, for wall_seconds
    # Import paths ("module:function") of callback factories, each `f(cfg) -> list`
    # of trainlab.train.callbacks.Callback; rank 0 builds them in its worker.
    callbacks: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # forwarded to workers (MLFLOW_*, ...)
    # Import paths of factories `f(alerts) -> rules` of the P0 rules every rank judges
    # (trainlab.train.metrics.P0Rules): the monitor's, named, not imported.
    p0_rules: tuple[str, ...] = ("trainlab.monitor.rules:p0_step_rules",)
    torch_threads: int = 1
    ray_job_id: str | None = None

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    @property
    def checkpoint_root(self) -> Path:
        return self.run_path / "checkpoints"

    @property
    def logs_dir(self) -> Path:
        return self.run_path / "logs"
