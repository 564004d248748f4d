"""A run that lives in object storage on a cluster whose nodes share no disk.

The local multi-node cluster (`trainlab cluster up --worker-nodes 2
--scratch-per-node`): three raylets on this machine, each with its own trainlab
scratch directory (TRAINLAB_SCRATCH_DIR of every process it starts), and an
S3-compatible server on 127.0.0.1 (moto's) holding the runs root and the
prepared dataset. A 2-worker run (each worker takes 2 of a node's 3 CPUs, so
the two sit on different raylets) is cut off with its cluster after its first
checkpoint (or a later one); every scratch directory is deleted and the cluster started again;
`trainlab train s3://.../RUN --resume` then ends bitwise equal to an
uninterrupted run of the same config, and nothing of the run exists outside
the store and the scratch directories.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TIMEOUT_S = 600


def _trainlab(*args: str, env: dict, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "trainlab"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory, s3_server):
    """The environment every command runs with (isolated trainlab home, the S3
    server's endpoint and test credentials), a bucket holding a prepared dataset,
    and the driver's own scratch directory."""
    import boto3

    from devtools.datasets import write_stdlib_dataset

    base = tmp_path_factory.mktemp("store-cluster")
    env = {
        **os.environ,
        "TRAINLAB_HOME": str(base / "home"),
        "TRAINLAB_SCRATCH_DIR": str(base / "driver-scratch"),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": s3_server,
    }
    for var in (
        "AWS_ENDPOINT_URL_S3",
        "AWS_PROFILE",
        "RAY_ADDRESS",
        "MLFLOW_TRACKING_URI",
        "RAY_AUTH_MODE",
    ):
        env.pop(var, None)
    s3 = boto3.client(
        "s3",
        region_name="us-east-1",
        endpoint_url=s3_server,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    bucket = f"store-{time.monotonic_ns()}"
    s3.create_bucket(Bucket=bucket)
    local = base / "prepared"
    write_stdlib_dataset(local, code_docs=40, prose_docs=120, vocab_size=2048)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        s3.upload_file(str(path), bucket, f"data/{path.relative_to(local).as_posix()}")
    shutil.rmtree(local)  # the store's copy is the only one
    return {"env": env, "s3": s3, "bucket": bucket, "base": base}


def _up(env: dict) -> dict:
    args = ["cluster", "up", "--num-cpus=3", "--worker-nodes=2", "--worker-cpus=3"]
    args += ["--scratch-per-node", "--json"]
    up = _trainlab(*args, env=env, timeout=900)
    assert up.returncode == 0, up.stderr[-3000:]
    return json.loads(up.stdout.strip().splitlines()[-1])


def _down(env: dict) -> None:
    down = _trainlab("cluster", "down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr[-2000:]


def _sets(bucket: str, runs: str) -> list[str]:
    items = [
        f"data.path=s3://{bucket}/data",
        "data.mix={code: 0.6, docs: 0.4}",
        "data.micro_batch_size=4",
        "model.vocab_size=2048",
        "resource.cpus_per_worker=2",
        f"train.runs_root=s3://{bucket}/{runs}",
        "train.total_steps=8",
        "train.warmup_steps=1",
        "train.log_interval=1",
        "train.eval_interval=2",
        "train.eval_batches=1",
        "train.checkpoint.every_steps=2",
        "train.deterministic=true",
        "tracking.system_metrics=false",
    ]
    return [a for item in items for a in ("--set", item)]


def _committed(s3, bucket: str, prefix: str) -> list[str]:
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    return sorted(k for k in keys if k.endswith("/checkpoint.json"))


def _submit(env: dict, dashboard: str, bucket: str, runs: str, follow: bool) -> dict:
    """`trainlab submit` of the tiny recipe with the runs root in the store: the
    driver runs as a job on the head node (its scratch is the head's)."""
    args = ["submit", "trainers/recipes/tiny.yaml", *_sets(bucket, runs), "--address", dashboard]
    proc = _trainlab(*args, *(["--follow"] if follow else []), "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(s3, bucket: str, run_uri: str) -> dict:
    key = f"{run_uri.removeprefix(f's3://{bucket}/')}/run_summary.json"
    return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def test_a_run_in_the_store_resumes_on_a_fresh_cluster_bitwise(world):
    env, s3, bucket = world["env"], world["s3"], world["bucket"]
    state = _up(env)
    dashboard = state["dashboard_url"]
    scratches = [Path(n["scratch_dir"]) for n in state["nodes"]] + [
        Path(env["TRAINLAB_SCRATCH_DIR"])
    ]
    assert len({str(s) for s in scratches}) == 4 and all(str(s) for s in scratches)
    try:
        # The uninterrupted reference, in its own prefix.
        ref = _submit(env, dashboard, bucket, "ref", follow=True)
        assert ref["status"] == "SUCCEEDED" and ref["run_dir"].startswith(f"s3://{bucket}/ref/")
        expected = _summary(s3, bucket, ref["run_dir"])
        # The run cut off with its whole cluster after its first checkpoint.
        job = _submit(env, dashboard, bucket, "runs", follow=False)
        run_uri = job["run_dir"]
        assert run_uri.startswith(f"s3://{bucket}/runs/")
        deadline = time.monotonic() + TIMEOUT_S
        while not _committed(s3, bucket, "runs/"):
            assert time.monotonic() < deadline, "no checkpoint committed in time"
            time.sleep(0.5)
    finally:
        _down(env)
    assert not _summary_exists(s3, bucket, run_uri)  # it never finished
    # The cluster goes down a few seconds after the first commit is seen; the run
    # may have committed another checkpoint meanwhile: the resume starts at the newest.
    newest = max(
        int(k.rsplit("/", 2)[1].removeprefix("step-")) for k in _committed(s3, bucket, "runs/")
    )
    assert 2 <= newest < 8, newest
    # Every node's scratch (and the driver's) is gone; a fresh cluster.
    for scratch in scratches:
        shutil.rmtree(scratch, ignore_errors=True)
    state = _up(env)
    scratches += [Path(n["scratch_dir"]) for n in state["nodes"]]
    try:
        from trainlab.jobs.client import connect

        client = connect(state["dashboard_url"])
        job_id = client.submit_job(entrypoint=f"trainlab train {run_uri} --resume --json")
        deadline = time.monotonic() + TIMEOUT_S
        while (status := str(client.get_job_status(job_id))) not in (
            "SUCCEEDED",
            "FAILED",
            "STOPPED",
        ):
            assert time.monotonic() < deadline, "the resume did not end in time"
            time.sleep(1)
        logs = client.get_job_logs(job_id)
    finally:
        _down(env)
    assert status == "SUCCEEDED", logs[-3000:]
    got = _summary(s3, bucket, run_uri)
    assert got["run_dir"] == run_uri and got["status"] == "completed"
    assert got["start_step"] == newest and got["final_step"] == 8
    assert got["weights_sha256"] == expected["weights_sha256"]
    assert got["final_loss"] == expected["final_loss"]
    # The records are in the store: the attempts, the summary, each rank's log.
    key = run_uri.removeprefix(f"s3://{bucket}/")
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=key)["Contents"]}
    assert {f"{key}/run_summary.json", f"{key}/config.yaml", f"{key}/logs/rank0.log",
            f"{key}/logs/rank1.log", f"{key}/logs/driver.log"} <= keys  # fmt: skip
    assert len([k for k in keys if "/logs/attempts.jsonl.d/" in k]) >= 2
    # Nothing of the run outside the store and the scratch directories.
    name = run_uri.rsplit("/", 1)[1]
    outside = [
        p
        for root in (REPO / "runs", world["base"], Path.cwd())
        if root.exists()
        for p in root.rglob(f"*{name}*")
        if not any(p.is_relative_to(s) for s in scratches)
    ]
    assert not outside, outside


def _summary_exists(s3, bucket: str, run_uri: str) -> bool:
    key = f"{run_uri.removeprefix(f's3://{bucket}/')}/run_summary.json"
    return bool(s3.list_objects_v2(Bucket=bucket, Prefix=key).get("Contents"))
