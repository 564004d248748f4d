"""A store outage of seconds in the middle of a real run (issue 38, item 2): the
runs root in object storage (moto's S3 behind tests/faultproxy.py), a 2-worker
`trainlab train` on a local Ray cluster it starts (its workers inherit the test
credentials, as a cluster's nodes have theirs). The store's endpoint goes away
(connections refused) for OUTAGE_S after a checkpoint, then returns: training
goes on through it (docs/storage.md: an outage fails a save or a record write,
never the run), the run completes at its last step with exit 0, no failure is
recorded, the summary and a checkpoint after the outage are in the store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.train_helpers import dataset_dir, tiny_config
from trainlab.config import to_yaml

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
OUTAGE_S = 8


def test_a_store_outage_mid_run_costs_no_step_and_no_record(
    s3_env, s3_server, tmp_path_factory, tmp_path
):
    s3, bucket = s3_env
    cfg = tiny_config(
        dataset_dir(tmp_path_factory),
        name="outage",
        resource={"num_workers": 2},
        train={"total_steps": STEPS, "log_interval": 2, "eval_interval": 20,
               "runs_root": f"s3://{bucket}/runs", "checkpoint": {"every_steps": 10}},
        tracking={"system_metrics": False},
    )  # fmt: skip
    config = tmp_path / "outage.yaml"
    config.write_text(to_yaml(cfg))

    def keys(suffix: str) -> list[str]:  # straight to the store, not through the proxy
        pages = s3.list_objects_v2(Bucket=bucket, Prefix="runs/")
        return sorted(o["Key"] for o in pages.get("Contents", []) if o["Key"].endswith(suffix))

    with FaultProxy(s3_server) as proxy:
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url, "TRAINLAB_STORE_RETRY_S": "20",
               "TRAINLAB_HOME": str(tmp_path / "home"),
               "TRAINLAB_SCRATCH_DIR": str(tmp_path / "scratch")}  # fmt: skip
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainlab", "train", str(config), "--json"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while not keys("step-00000010/checkpoint.json"):
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "no checkpoint at step 10 in time"
                time.sleep(0.2)
            proxy.down()  # the endpoint is gone: connections refused
            time.sleep(OUTAGE_S)
            assert proc.poll() is None, proc.communicate()[1][-3000:]  # it trains on
            proxy.up()
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    logs = "".join(
        s3.get_object(Bucket=bucket, Key=k)["Body"].read().decode() for k in keys(".log")
    )
    assert proc.returncode == 0, (err[-3000:], logs[-8000:])
    # the outage was felt (and said once per kind, not per request)
    assert "could not upload the logs" in logs and "not read" in logs, logs[-5000:]
    assert "Traceback" not in err, err[err.find("Traceback") - 300 :][:3000]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["final_step"] == STEPS
    assert summary["restarts"] == 0 and not summary.get("failures")
    key = summary["run_dir"].removeprefix(f"s3://{bucket}/")
    stored = json.loads(s3.get_object(Bucket=bucket, Key=f"{key}/run_summary.json")["Body"].read())
    assert stored["status"] == "completed" and stored["final_step"] == STEPS
    assert keys(f"step-{STEPS:08d}/checkpoint.json")  # a checkpoint after the outage
    failures = [k for k in keys(".json") if "/logs/failures.jsonl.d/" in k]
    assert failures == []
