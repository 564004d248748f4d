"""What the driver hands every training worker: small, picklable, no torch.

The config arrives here validated and with its layout resolved, once: workers
read `job.cfg` as the typed `ExperimentConfig` and never validate it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainlab.config import ExperimentConfig
from trainlab.run.location import RunLocation

# The Ray node id of a training worker's node, in its environment (set by
# trainlab.train.driver.worker; train.chaos.kill_node_at_steps reads it).
NODE_ID_ENV = "TRAINLAB_NODE_ID"


@dataclass(frozen=True)
class TrainJob:
    cfg: ExperimentConfig  # layout resolved (parallel.strategy in ddp/fsdp)
    plan: dict[str, Any]  # Plan.to_json()
    run_dir: str  # absolute path, or the URI of a run in object storage
    config_hash: str
    dataset_fingerprint: str
    manifest_path: str  # absolute
    data_spec: Any  # trainlab.data.DataSpec
    sources: tuple[str, ...]  # source names, in manifest order
    session: str  # one `trainlab train` invocation; attempts of it share this id
    started_at: float  # driver's time.time() at launch, for wall_seconds
    # Import paths ("module:function") of callback factories, each `f(cfg) -> list`
    # of trainlab.train.loop.callbacks.Callback; rank 0 builds them in its worker.
    callbacks: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # forwarded to workers (MLFLOW_*, ...)
    # Import paths of factories `f(alerts) -> rules` of the P0 rules every rank judges
    # (trainlab.train.loop.metrics.P0Rules): the monitor's, named, not imported.
    p0_rules: tuple[str, ...] = ("trainlab.monitor.rules:p0_step_rules",)
    # ... and those judged from an MoE's router metrics at each logged step.
    p0_router_rules: tuple[str, ...] = ("trainlab.monitor.rules:p0_router_rules",)
    torch_threads: int = 1
    ray_job_id: str | None = None
    # Ray's id of the driver's node: train.chaos.kill_node_at_steps never loses it.
    driver_node_id: str | None = None
    # An elastic run's job pinned to one size (`at_world_size`): it grows at a
    # checkpoint taken for it (trainlab.train.loop.growth).
    elastic: bool = False
    # The driver that started the group: its lock record (host, pid, since). The
    # agents and rank 0's commits stop when it is gone (`orphaned`); None: unchecked.
    driver: tuple[str, int, float] | None = None

    def orphaned(self) -> str | None:
        """Why this job's worker group must stop (its driver is gone, or another
        holds the run: trainlab.run.holder.orphaned), or None."""
        if self.driver is None:
            return None
        from trainlab.run.holder import orphaned

        return orphaned(self.location, self.driver)

    def at_world_size(self, n: int) -> TrainJob:
        """This job for a worker group of `n` workers: an elastic run's config pinned
        to the size Ray placed (ExperimentConfig.at_world_size), else itself."""
        if not self.cfg.resource.elastic:
            return self
        from dataclasses import replace

        return replace(self, cfg=self.cfg.at_world_size(n), elastic=True)

    @property
    def location(self) -> RunLocation:
        """Where the run lives (`run_dir`: a path, or a URI in object storage)."""
        return RunLocation.of(self.run_dir, self.cfg.resource.scratch_dir)

    @property
    def run_path(self) -> Path:
        """This node's directory of the run: the run directory, or for a run in
        object storage its working copy on this node's scratch."""
        return self.location.local

    @property
    def checkpoint_root(self) -> Path:
        return self.run_path / "checkpoints"

    @property
    def logs_dir(self) -> Path:
        return self.run_path / "logs"


def in_process_job(
    cfg: ExperimentConfig, run_dir: Path, session: str, *, synthetic_source: str | None = None
) -> TrainJob:
    """What the launcher would hand a worker, for driving the training loop in one
    process (tests, benchmarks, the GPU check): the layout resolved, the run's data
    prepared (or, with `synthetic_source`, none: the caller feeds a synthetic stream
    of that name, and nothing in the trainer reads `data_spec`), the run
    directory's logs/ and checkpoints/ made."""
    import time

    from trainlab.config import config_hash
    from trainlab.plan import plan, resolve_layout

    cfg = resolve_layout(cfg)
    spec = None
    if synthetic_source is None:
        from trainlab.data import prepare_run_data

        spec = prepare_run_data(cfg)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    return TrainJob(
        cfg=cfg,
        plan=plan(cfg).to_json(),
        run_dir=str(run_dir),
        config_hash=config_hash(cfg),
        dataset_fingerprint=spec.fingerprint if spec else "synthetic",
        manifest_path=f"{spec.path.rstrip('/')}/manifest.json" if spec else "",
        data_spec=spec,
        sources=tuple(spec.sources) if spec else (synthetic_source,),
        session=session,
        started_at=time.time(),
    )
