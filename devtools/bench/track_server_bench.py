"""Logging overhead of a team's tracking server (docs/tracking-teams.md) next to
the embedded store, in the same run.

Value: logged steps per second through trainlab's callbacks (`default_callbacks`,
the same round as devtools/bench/track_bench.py: timed until every point is in
the store and read back) into `mlflow server` on PostgreSQL with sign-in
(`trainlab tracking up`, started here in a throwaway directory). Baseline: the
same rounds into the embedded SQLite store. The sides alternate ROUNDS times
(the machine is shared) and each is the median; ratio = server / embedded
(higher is better; below 1 the server is slower).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from devtools.bench import BenchResult
from devtools.bench.track_bench import STEPS, _metrics, _trainlab_round

ROUNDS = 3
CLIENT_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def bench_tracking_server() -> list[BenchResult]:
    from trainlab.config import load_config
    from trainlab.track.server import free_port, read_password, server_down, server_up

    saved = {k: os.environ.get(k) for k in CLIENT_ENV}
    tmp = Path(tempfile.mkdtemp(prefix="trainlab-bench-server-"))
    tmp.chmod(0o711)  # run as root, the database runs as `postgres` and passes through
    server: list[dict[str, Any]] = []
    embedded: list[dict[str, Any]] = []
    try:
        state = server_up(tmp / "server", port=free_port())
        signed_in = {
            "MLFLOW_TRACKING_URI": state.uri,
            "MLFLOW_TRACKING_USERNAME": "admin",
            "MLFLOW_TRACKING_PASSWORD": read_password(state.dir),
        }
        root = tmp / "runs"
        cfg = load_config(
            Path("trainers/recipes/tiny.yaml"),
            [f"train.runs_root={root}", "tracking.system_metrics=false"],
        )
        for i in range(ROUNDS):  # server, embedded, server, embedded, ...
            os.environ.update(signed_in)
            server.append(_trainlab_round(cfg, root / "2026-01-01" / f"server-{i}"))
            for k in CLIENT_ENV:
                os.environ.pop(k, None)
            embedded.append(_trainlab_round(cfg, root / "2026-01-01" / f"embedded-{i}"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server_down(tmp / "server")
        shutil.rmtree(tmp, ignore_errors=True)
    server_s = statistics.median(r["stored_s"] for r in server)
    embedded_s = statistics.median(r["stored_s"] for r in embedded)
    return [
        BenchResult(
            "tracking_server_steps_per_s",
            STEPS / server_s,
            "logged steps/s (until stored)",
            "embedded_store_steps_per_s",
            STEPS / embedded_s,
            notes={
                "statistic": f"median of {ROUNDS} interleaved rounds of {STEPS} steps each",
                "server": "mlflow server --app-name basic-auth on PostgreSQL, 127.0.0.1",
                "server_ms_per_logged_step_until_stored": round(1000 * server_s / STEPS, 2),
                "embedded_ms_per_logged_step_until_stored": round(1000 * embedded_s / STEPS, 2),
                "server_ms_per_logged_step_the_step_waits": round(
                    1000 * statistics.median(r["waited_s"] for r in server) / STEPS, 2
                ),
                "embedded_ms_per_logged_step_the_step_waits": round(
                    1000 * statistics.median(r["waited_s"] for r in embedded) / STEPS, 2
                ),
                "run_start_s": {
                    "server": round(statistics.median(r["start_s"] for r in server), 2),
                    "embedded": round(statistics.median(r["start_s"] for r in embedded), 2),
                },
                "loss_points_stored": {
                    "server": [r["stored_points"] for r in server],
                    "embedded": [r["stored_points"] for r in embedded],
                },
                "metrics_per_step": len(_metrics(1)),
                "rounds_s": {
                    "server": [round(r["stored_s"], 2) for r in server],
                    "embedded": [round(r["stored_s"], 2) for r in embedded],
                },
            },
        )
    ]
