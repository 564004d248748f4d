"""A store outage of seconds in the middle of a real run (issue 38, item 2): the
runs root in object storage (moto's S3 behind tests/faultproxy.py), a 2-worker
`trainlab train` on a local Ray cluster it starts (its workers inherit the test
credentials, as a cluster's nodes have theirs). After the first checkpoint the
store's endpoint goes away (open connections cut, new ones refused):

- for OUTAGE_S, then back: training goes on through it (docs/storage.md: an
  outage fails a save or a record write, never the run); the run completes at its
  last step with exit 0, no failure recorded, the summary and a checkpoint after
  the outage in the store. (It used to end within 2 s: an agent's read of the
  attempt's failed flag raised, its training process died, Ray Train gave up.)
- a Ctrl-C during it (`extended`): the stop cannot be asked through the store, so
  it is at once, exit 130, no traceback, and the summary says the kept checkpoint
  is not known now rather than "nothing". Measured 24-42 s from the Ctrl-C to the
  exit (each unanswered request costs the S3 SDK's own retries). Extended because
  1 of 8 runs here ended in SIGSEGV (exit -11) after the summary was printed,
  somewhere in the driver's teardown with the S3 client in use (not found yet);
  the same Ctrl-C path without Ray is tests/unit/train/test_interrupt.py."""

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
EVERY = 10
OUTAGE_S = 8


class OutageRun:
    """`trainlab train` of a 2-worker, STEPS-step run whose runs root is in the
    store behind `proxy`; `keys` lists the store's objects straight from moto."""

    def __init__(self, s3, bucket: str, proxy: FaultProxy, dataset: Path, tmp_path: Path):
        self.s3, self.bucket, self.scratch = s3, bucket, tmp_path / "scratch"
        cfg = tiny_config(
            dataset,
            name="outage",
            resource={"num_workers": 2},
            train={"total_steps": STEPS, "log_interval": 2, "eval_interval": 20,
                   "runs_root": f"s3://{bucket}/runs", "checkpoint": {"every_steps": EVERY}},
            tracking={"system_metrics": False},
        )  # fmt: skip
        config = tmp_path / "outage.yaml"
        config.write_text(to_yaml(cfg))
        env = {**os.environ, "AWS_ENDPOINT_URL": proxy.url, "TRAINLAB_STORE_RETRY_S": "20",
               "TRAINLAB_HOME": str(tmp_path / "home"),
               "TRAINLAB_SCRATCH_DIR": str(tmp_path / "scratch")}  # fmt: skip
        env.pop("RAY_ADDRESS", None)
        env["PYTHONFAULTHANDLER"] = "1"  # a crash says where
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainlab", "train", str(config), "--json"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip

    def keys(self, suffix: str) -> list[str]:
        pages = self.s3.list_objects_v2(Bucket=self.bucket, Prefix="runs/")
        return sorted(o["Key"] for o in pages.get("Contents", []) if o["Key"].endswith(suffix))

    def wait_for_first_checkpoint(self) -> None:
        deadline = time.monotonic() + 300
        while not self.keys("step-00000010/checkpoint.json"):
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint at step 10 in time"
            time.sleep(0.2)

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted(self.scratch.rglob("logs/*.log")))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture
def outage_run(s3_env, s3_server, tmp_path_factory, tmp_path):
    s3, bucket = s3_env
    with FaultProxy(s3_server) as proxy:
        run = OutageRun(s3, bucket, proxy, dataset_dir(tmp_path_factory), tmp_path)
        try:
            run.wait_for_first_checkpoint()
            yield run, proxy
        finally:
            run.kill()


def test_a_store_outage_mid_run_costs_no_step_and_no_record(outage_run):
    run, proxy = outage_run
    proxy.down()  # the endpoint is gone: connections cut and refused
    time.sleep(OUTAGE_S)
    assert run.proc.poll() is None, run.proc.communicate()[1][-3000:]  # it trains on
    proxy.up()
    out, err = run.proc.communicate(timeout=300)
    logs = run.logs()
    assert run.proc.returncode == 0, (err[-3000:], logs[-8000:])
    # the outage was felt (the agents look at the failed flag every 0.5 s; the
    # logs are shipped every 30 s, so whether a shipment fell in it is chance),
    # and said once per kind, not per request
    assert "failed flag was not read" in logs, logs[-5000:]
    assert logs.count("failed flag was not read") <= 4  # once a minute per rank at most
    assert "Traceback" not in err, err[err.find("Traceback") - 300 :][:3000]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["final_step"] == STEPS
    assert summary["restarts"] == 0 and not summary.get("failures")
    key = summary["run_dir"].removeprefix(f"s3://{run.bucket}/")
    got = run.s3.get_object(Bucket=run.bucket, Key=f"{key}/run_summary.json")
    stored = json.loads(got["Body"].read())
    assert stored["status"] == "completed" and stored["final_step"] == STEPS
    assert run.keys(f"step-{STEPS:08d}/checkpoint.json")  # a checkpoint after the outage
    assert [k for k in run.keys(".json") if "/logs/failures.jsonl.d/" in k] == []


@pytest.mark.extended
def test_ctrl_c_during_a_store_outage_stops_at_once_in_one_line(outage_run):
    run, proxy = outage_run
    proxy.down()
    time.sleep(1)
    os.killpg(run.proc.pid, signal.SIGINT)
    t0 = time.monotonic()
    out, err = run.proc.communicate(timeout=180)
    took = time.monotonic() - t0
    proxy.up()
    assert run.proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[err.find("Traceback") - 300 :][:3000]
    assert "interrupt: the run's storage does not answer (" in err
    assert "kept:            not known now (the run's storage did not answer)" in err
    assert took < 90, took  # seconds of tries, not every retry of every record
