"""run_summary.json and the run's failure and attempt records.

Keys checked from outside (keep them): name, status, final_step, final_loss,
val_loss, tokens_seen, restarts, weights_sha256, last_checkpoint,
best_checkpoint, wall_seconds. `status` is "completed", "stopped" (a callback
asked) or "failed" (then `error` and `failures`: one entry per failed rank and
attempt, with step, rank and error).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from trainlab.train import checkpoint as ck
from trainlab.train.job import TrainJob


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """run_summary.json, written atomically."""
    path = run_dir / "run_summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def read_failures(run_dir: Path, session: str | None = None) -> list[dict[str, Any]]:
    """Failures recorded in logs/failures.jsonl (of one session when given), oldest first."""
    records = _jsonl(run_dir / "logs" / "failures.jsonl")
    return [r for r in records if session is None or r.get("session") == session]


def read_attempts(run_dir: Path) -> list[dict[str, Any]]:
    """Every start of the training processes in this run directory (logs/attempts.jsonl)."""
    return [r for r in _jsonl(run_dir / "logs" / "attempts.jsonl") if "start_step" in r]


def read_first_steps(run_dir: Path) -> list[dict[str, Any]]:
    """When each attempt completed its first step: {"session", "first_step", "time"}."""
    return [r for r in _jsonl(run_dir / "logs" / "attempts.jsonl") if "first_step" in r]


# kinds of failure records: infrastructure (the process or worker was killed or lost;
# a retry can succeed), code (an exception that would happen again), peer (a side
# effect of another rank's failure).
INFRASTRUCTURE_KINDS = {"killed", "chaos", "lost"}
FAILURE_KINDS = {*INFRASTRUCTURE_KINDS, "error", "peer"}


def failure_cause(failures: list[dict[str, Any]]) -> str:
    """ "infrastructure" when the last failure killed or lost a process, else "code"."""
    if not failures:
        return "code"
    last_event = failures[-1].get("event")
    kinds = {f.get("kind") for f in failures if f.get("event") == last_event}
    return "infrastructure" if kinds & INFRASTRUCTURE_KINDS else "code"


def failed_summary(job: TrainJob, error: str) -> dict[str, Any]:
    """The summary of a run that ran out of restarts: every failure with its step,
    rank and error, and the checkpoint a later --run-dir/--resume would use."""
    from trainlab.config import ExperimentConfig

    cfg = ExperimentConfig.model_validate(job.cfg)
    root = job.checkpoint_root
    newest = ck.find_resume(root, require_valid=cfg.train.checkpoint.validate)
    best = ck.best(ck.committed(root))
    step = newest.step if newest else 0
    failures = read_failures(job.run_path, job.session)
    return {
        "name": cfg.name,
        "status": "failed",
        "final_step": step,
        "final_loss": None,
        "val_loss": best.val_loss if best else None,
        "tokens_seen": step * cfg.global_batch_size * cfg.data.seq_len,
        "restarts": max(0, len(read_attempts(job.run_path)) - 1),
        "weights_sha256": None,
        "last_checkpoint": str(newest.path) if newest else None,
        "best_checkpoint": str(best.path) if best else None,
        "wall_seconds": round(time.time() - job.started_at, 3),
        "run_dir": job.run_dir,
        "config_hash": job.config_hash,
        "dataset_fingerprint": job.dataset_fingerprint,
        "error": error,
        "failures": failures,
        "failure_cause": failure_cause(failures),
    }


def last_logged_step(logs: Path) -> int | None:
    """The newest step rank 0 logged (logs/progress.json, written at each log interval)."""
    try:
        return int(json.loads((logs / "progress.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
