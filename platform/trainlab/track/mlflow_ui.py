"""`trainlab ui`: MLflow's own server and UI, with trainlab's experiments opening
on their runs table.

MLflow 3.17's UI chooses an experiment's landing page from the sidebar's
"GenAI | Model training" switch, a preference kept in the browser (localStorage
`mlflow.workflowType_v1`, "genai" when unset), not from the experiment's
`mlflow.experimentKind` tag: a model-training experiment opened in a browser
that never touched the switch lands on the GenAI overview (traces, latency,
"No data available"), its runs only under `#/experiments/N/runs`, a run's
breadcrumb "Evaluations". No server setting or tag changes that.

So `trainlab ui` runs `mlflow server --app-name trainlab` (this module's
`create_app`, the `mlflow.app` entry point in pyproject.toml): MLflow's app as
it is, except that its page sets the preference to "Model training" in a
browser that has none yet. A choice made with the switch stays the browser's.
tests/unit/track/test_track_ui.py checks it in a real browser.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

# `mlflow server --app-name`: pyproject.toml's [project.entry-points."mlflow.app"].
APP_NAME = "trainlab"
# MLflow's UI keeps the switch under this localStorage key, the value JSON-encoded.
WORKFLOW_KEY = "mlflow.workflowType_v1"
MODEL_TRAINING = "machine_learning"
_KEY, _VALUE = json.dumps(WORKFLOW_KEY), json.dumps(json.dumps(MODEL_TRAINING))
DEFAULT_WORKFLOW_SCRIPT = (
    f"<script>try{{if(localStorage.getItem({_KEY})===null)"
    f"localStorage.setItem({_KEY},{_VALUE})}}catch(e){{}}</script>"
)


def installed() -> bool:
    """The app is registered with MLflow (an install of this checkout made after it
    was added; `make setup` reinstalls)."""
    return any(ep.name == APP_NAME for ep in metadata.entry_points(group="mlflow.app"))


def page_with_default(index_html: str) -> str:
    """MLflow's index.html with the workflow default set before its bundle runs."""
    head = index_html.find("<head>")
    if head < 0:
        return DEFAULT_WORKFLOW_SCRIPT + index_html
    at = head + len("<head>")
    return index_html[:at] + DEFAULT_WORKFLOW_SCRIPT + index_html[at:]


def create_app() -> Any:
    """MLflow's ASGI app (what `mlflow server` runs) with its page served by
    `page_with_default` (uvicorn calls this: a factory)."""
    from flask import Response
    from mlflow.server import app as flask_app
    from mlflow.server import serve as mlflow_serve
    from mlflow.server.fastapi_app import app

    index = Path(str(flask_app.static_folder)) / "index.html"

    def serve() -> Any:
        if not index.is_file():
            return mlflow_serve()  # MLflow's own message for a build without its UI
        return Response(page_with_default(index.read_text()), mimetype="text/html")

    flask_app.view_functions["serve"] = serve
    return app
