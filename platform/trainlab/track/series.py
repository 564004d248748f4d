"""Reading a run's metric histories from MLflow (one reader for the run's own
curves artifacts, `trainlab compare` and the notebooks; imports nothing of
trainlab, so the callback and the query layer can both use it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient


def metric_series(
    client: MlflowClient, run_id: str, prefixes: Sequence[str] = ("",)
) -> dict[str, list[tuple[int, float]]]:
    """Every metric of the run whose name is, or starts with, one of `prefixes`,
    as (step, value) points sorted by step."""
    run = client.get_run(run_id)
    out = {}
    for key in sorted(run.data.metrics):
        if any(_matches(key, p) for p in prefixes):
            points = client.get_metric_history(run_id, key)
            out[key] = sorted((m.step, m.value) for m in points)
    return out


def _matches(key: str, prefix: str) -> bool:
    """ "loss" matches only loss; "val_loss/" (or "") matches everything under it."""
    return key.startswith(prefix) if prefix.endswith("/") or not prefix else key == prefix
