"""Google Cloud Storage as a backend: `gs://bucket/prefix`, through pyarrow's
GCS filesystem.

As Google's own clients do, an emulator's endpoint comes from
STORAGE_EMULATOR_HOST (`http://127.0.0.1:9023` or `127.0.0.1:9023`; requests
then go unauthenticated, as emulators expect), the project from
GOOGLE_CLOUD_PROJECT, and credentials only from the environment's standard
sources (GOOGLE_APPLICATION_CREDENTIALS, the gcloud default credentials, or
the node's service account).
"""

from __future__ import annotations

import datetime
import os
from typing import Any
from urllib.parse import urlsplit

from trainlab.location.core import Backend
from trainlab.redact import redact

EMULATOR_ENV_VAR = "STORAGE_EMULATOR_HOST"
PROJECT_ENV_VARS = ("GOOGLE_CLOUD_PROJECT", "GCLOUD_PROJECT")
SCHEMES = ("gs", "gcs")
SETTINGS_ENV_VARS = (EMULATOR_ENV_VAR, *PROJECT_ENV_VARS)
CREDENTIALS_HINT = "GOOGLE_APPLICATION_CREDENTIALS (or the node's service account)"
# How long the client retries a request that failed for a transient reason; the
# callers above retry with their own backoff (trainlab.location.errors).
RETRY_LIMIT_S = 20


class GCS(Backend):
    scheme = "gs"
    settings_hint = (
        "GOOGLE_APPLICATION_CREDENTIALS, GOOGLE_CLOUD_PROJECT (and STORAGE_EMULATOR_HOST)"
    )

    def __init__(self, emulator: str | None, project: str | None):
        self.emulator, self.project = emulator, project

    def make_filesystem(self) -> Any:
        from pyarrow import fs

        kwargs: dict[str, Any] = {"retry_time_limit": datetime.timedelta(seconds=RETRY_LIMIT_S)}
        if self.project:
            kwargs["project_id"] = self.project
        if self.emulator:
            ep = urlsplit(self.emulator if "://" in self.emulator else f"http://{self.emulator}")
            kwargs.update(anonymous=True, endpoint_override=ep.netloc, scheme=ep.scheme)
        return fs.GcsFileSystem(**kwargs)

    def list(self, path: str) -> list[str]:
        """pyarrow lists a GCS folder without the folders implied by deeper objects
        (it reads the objects, not the prefixes): take the first part of every
        name below instead."""
        from pyarrow import fs

        base = path.rstrip("/") + "/"
        sel = fs.FileSelector(path, recursive=True, allow_not_found=True)
        try:
            entries = self.filesystem.get_file_info(sel)
        except FileNotFoundError:
            return []
        return sorted({e.path.removeprefix(base).split("/", 1)[0] for e in entries} - {""})

    def describe(self) -> str:
        return f"emulator {redact(self.emulator)}" if self.emulator else ""


_BACKENDS: dict[tuple[str | None, str | None], GCS] = {}


def backend() -> GCS:
    """The GCS backend for this process's settings."""
    key = (
        os.environ.get(EMULATOR_ENV_VAR) or None,
        next((os.environ[v] for v in PROJECT_ENV_VARS if os.environ.get(v)), None),
    )
    if key not in _BACKENDS:
        _BACKENDS[key] = GCS(*key)
    return _BACKENDS[key]
