"""What the driver hands every training worker: small, picklable, no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainJob:
    cfg: dict[str, Any]  # ExperimentConfig.model_dump(mode="json"), layout resolved
    plan: dict[str, Any]  # Plan.to_json()
    run_dir: str  # absolute
    config_hash: str
    dataset_fingerprint: str
    manifest_path: str  # absolute
    data_spec: Any  # trainlab.data.DataSpec
    sources: list[str]  # source names, in manifest order
    session: str  # one `trainlab train` invocation; attempts of it share this id
    started_at: float  # driver's time.time() at launch, for wall_seconds
    env: dict[str, str] = field(default_factory=dict)  # forwarded to workers (MLFLOW_*, ...)
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["data_spec"] = self.data_spec  # keep the object (asdict would flatten a dataclass)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainJob:
        return cls(**d)
