"""The export in the run's MLflow record: `export.json` (source checkpoint,
transformers class, every file's sha256 and the export's checksum) and the
model's config files as artifacts under `exports/step-N-<dtype>/`, and tags
`export.latest.*` naming the directory and checksum, so the UI shows which
run produced which exported model. The run is found as the training run
itself continues it (trainlab.track: by its run directory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainlab.track.backend import embedded_db_path, tracking_uri
from trainlab.track.mlflow_cb import MlflowCallback

LOGGED_FILES = ("export.json", "config.json", "generation_config.json", "tokenizer_config.json")


def log_export(cfg: Any, run_dir: Path | str, out: Path, record: dict[str, Any]) -> str | None:
    """Attach the export in `out` to the MLflow run of `run_dir` (a path, or the URI
    of a run in object storage) in the store of the run's runs root; returns the run
    id, or None when the run has no record (e.g. the store was never created)."""
    uri = tracking_uri(cfg.train.runs_root)
    db = embedded_db_path(uri)
    if db is not None and not db.exists():
        return None
    tracker = MlflowCallback(cfg)
    if not tracker.attach(str(run_dir)):
        return None
    artifact_dir = f"exports/step-{record['step']:08d}-{record['dtype']}"
    for name in LOGGED_FILES:
        if (out / name).exists():
            tracker.log_artifact(str(out / name), artifact_dir)
    tracker.set_tags(
        {
            "export.latest.path": str(out),
            "export.latest.sha256": record["sha256"],
            "export.latest.step": str(record["step"]),
            "export.latest.class": record["hf_class"],
            "export.latest.artifacts": artifact_dir,
        }
    )
    tracker.finish()  # what the store did not take waits in the run's journal
    return tracker.run_id
