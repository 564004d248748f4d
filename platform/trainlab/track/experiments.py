"""MLflow experiments of training runs (kept apart from trainlab.track.backend so
the journal, which the store's opening calls, can create them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient

# MLflow (3.x) records an experiment's kind in this tag; its UI opens a
# `custom_model_development` experiment on the training runs table, where an
# untagged one may be taken for GenAI (traces) and opened on an empty view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"


def get_or_create_experiment(client: MlflowClient, name: str, artifact_root: str | None) -> str:
    """The id of experiment `name`, created (with `artifact_root`) when missing, as
    a model-training experiment (EXPERIMENT_KIND_TAG)."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if EXPERIMENT_KIND_TAG not in exp.tags:  # created before trainlab set it
            client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        return exp.experiment_id
    try:
        # Run ids are unique, so every experiment can share the artifact root:
        # a run's files land in {root}/{run_id}/artifacts.
        return client.create_experiment(
            name,
            artifact_location=artifact_root,
            tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND},
        )
    except MlflowException:
        # Another process created it between our lookup and create.
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id
