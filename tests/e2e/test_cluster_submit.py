"""A real multi-node Ray cluster on this machine (`ray start --head` plus two
more raylets joining it with `ray start --address`, all on 127.0.0.1 with token
auth), started and stopped by trainlab's own `cluster up/down` code, and
training jobs submitted to it:

- `trainlab submit --follow --json`: SUCCEEDED, the two training workers on two
  different nodes, the run recorded in MLflow under the job's id (a run whose
  home is object storage: tests/e2e/test_store_cluster.py);
- plain `ray job submit --working-dir . -- python trainers/pretrain.py ...`
  (docs/cluster.md's command, absolute data and runs paths): SUCCEEDED and recorded;
- a training worker's process, or its whole node (the raylet), killed mid-run
  with no Ray Train restarts left: the job-level retry excludes that node (and
  says so), its workers run on other nodes, and the run resumes from its
  checkpoint;
- `trainlab prep` as a driver of the cluster: units on several nodes, the same
  dataset as a single-process prep;
- refusals before anything trains (data unreachable, failed rehearsal), `stop`.

The cluster is its own (not the session's `ray_cluster`), shared by this module.
Each node has 3 logical CPUs and each training worker takes 2, so a 2-worker
run always spans two nodes, and losing one leaves room to restart on the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
JOB_TIMEOUT_S = 600
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def trainlab_home(tmp_path_factory):
    """Isolate trainlab's local state (cluster.json, logs) for this module."""
    home = tmp_path_factory.mktemp("trainlab-home")
    saved = os.environ.get("TRAINLAB_HOME")
    os.environ["TRAINLAB_HOME"] = str(home)
    yield home
    if saved is None:
        os.environ.pop("TRAINLAB_HOME", None)
    else:
        os.environ["TRAINLAB_HOME"] = saved


def _trainlab(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "trainlab"), *args], capture_output=True, text=True, timeout=timeout, **kwargs
    )


@pytest.fixture(scope="module")
def s3_bucket(s3_server):
    """A bucket on the local S3-compatible server; its endpoint and (test)
    credentials in the environment the cluster's nodes start from, as an
    instance role or the nodes' own environment would provide them."""
    import boto3

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": s3_server,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=s3_server)
    bucket = f"e2e-{time.monotonic_ns()}"
    s3.create_bucket(Bucket=bucket)
    yield s3, bucket
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def cluster(trainlab_home, ray_cluster, s3_bucket):
    """Started and stopped with `trainlab cluster up/down`, while another Ray instance
    (the session's) runs on this machine, as on a shared box: nothing of ours may
    mistake it for our cluster."""
    import shutil

    from trainlab.rayjobs.localcluster import ClusterState, group_members

    up = _trainlab(
        "cluster",
        "up",
        "--num-cpus=3",
        "--worker-nodes=2",
        "--worker-cpus=3",
        "--json",
        timeout=900,
    )
    assert up.returncode == 0, up.stderr[-3000:]
    state = ClusterState.from_json(json.loads(up.stdout.strip().splitlines()[-1]))
    status = _trainlab("cluster", "status")  # what `up` prints without --json
    assert state.dashboard_url in status.stdout
    assert "submit trainers/recipes/tiny.yaml --follow" in status.stdout
    yield state
    down = _trainlab("cluster", "down")
    assert down.returncode == 0 and "stopped the local cluster" in down.stdout, down.stderr
    assert not any(group_members(n.pgid) for n in state.nodes), "processes left behind"
    for node in state.nodes:
        shutil.rmtree(node.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from devtools.datasets import write_stdlib_dataset

    root = tmp_path_factory.mktemp("prepared")
    write_stdlib_dataset(root, code_docs=60, prose_docs=200, vocab_size=2048)
    return root


def overrides(dataset: Path, runs: Path, steps: int, every: int) -> list[str]:
    return [
        f"data.path={dataset}",
        "data.mix={code: 0.6, docs: 0.4}",
        "data.micro_batch_size=4",
        "model.vocab_size=2048",
        "resource.cpus_per_worker=2",
        f"train.runs_root={runs}",
        f"train.total_steps={steps}",
        "train.warmup_steps=1",
        "train.log_interval=1",
        f"train.eval_interval={every}",
        "train.eval_batches=1",
        f"train.checkpoint.every_steps={every}",
        "tracking.system_metrics=false",
    ]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _client(cluster):
    from trainlab.rayjobs.client import connect

    return connect(cluster.dashboard_url)


def _mlflow_run(runs: Path, job_id: str):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{runs}/mlflow.db")
    exps = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(exps, filter_string=f"tags.ray_job_id = '{job_id}'")
    assert len(found) == 1, f"expected one MLflow run tagged with job {job_id}"
    return found[0]


def _worker_nodes(cluster, job_id: str) -> set[str]:
    """Node ids of the job's Ray Train workers, from the cluster's state API."""
    ray_job_id = _client(cluster).get_job_info(job_id).job_id
    return {a["node_id"] for a in _train_actors(cluster) if a.get("job_id") == ray_job_id}


def _train_actors(cluster) -> list[dict]:
    """Every Ray Train worker actor of the cluster (any job), from its state API."""
    from trainlab.rayjobs.auth import auth_headers

    query = urllib.parse.urlencode(
        {
            "filter_keys": "class_name",
            "filter_predicates": "=",
            "filter_values": "RayTrainWorker",
            "detail": "1",
            "limit": "1000",
        }
    )
    req = urllib.request.Request(
        f"{cluster.dashboard_url}/api/v0/actors?{query}", headers=auth_headers()
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)["data"]["result"]["result"]


def _summary(run_dir: str | Path) -> dict:
    return json.loads((Path(run_dir) / "run_summary.json").read_text())


@pytest.fixture
def hook_server():
    """A webhook endpoint on 127.0.0.1 recording the JSON bodies posted to it."""
    import http.server
    import threading

    posted: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            posted.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", posted
    server.shutdown()


def test_trainlab_submit_runs_across_both_nodes_and_is_recorded(
    cluster, dataset, tmp_path, s3_bucket, hook_server
):
    s3, bucket = s3_bucket
    runs = tmp_path / "runs"
    # No RAY_AUTH_MODE: trainlab finds the token and sends it itself.
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    # An alert hook whose URL (a secret) is set only where `submit` runs, not on the
    # cluster's nodes; a stale-checkpoint limit every step exceeds makes a P1 fire.
    hook_url = f"{hook_server[0]}/hooks/fake-secret-{time.time_ns()}"
    env["TRAINLAB_E2E_HOOK"] = hook_url
    alert_sets = [
        "tracking.alerts.hooks.e2e.webhook_url_env=TRAINLAB_E2E_HOOK",
        "tracking.alerts.routes.P1=[log, mlflow, e2e]",
        "tracking.alerts.stale_checkpoint.minutes=0.0001",
    ]
    proc = subprocess.run(
        [
            str(BIN / "trainlab"),
            "submit",
            "trainers/recipes/tiny.yaml",
            *_sets(overrides(dataset, runs, steps=4, every=2) + alert_sets),
            "--address",
            cluster.dashboard_url,
            "--follow",
            "--json",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) >= {"job_id", "address", "run_dir"}
    assert result["address"] == cluster.dashboard_url and result["status"] == "SUCCEEDED"
    assert result["run_dir"].startswith(str(runs))
    summary = _summary(result["run_dir"])
    assert (summary["status"], summary["final_step"]) == ("completed", 4)
    run = _mlflow_run(runs, result["job_id"])
    assert run.info.status == "FINISHED" and "loss" in run.data.metrics
    # The job ran from a copy without .git; the submission told it its version (a
    # commit of this repo: HEAD then, or an ancestor of HEAD if others committed since).
    commit = run.data.tags["git_commit"]
    is_ours = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO)
    assert commit != "unknown" and is_ours.returncode == 0, commit
    assert len(_worker_nodes(cluster, result["job_id"])) == 2
    # Ray Train's placement-group cleaner looked up its own cluster, not the other one.
    job_logs = _client(cluster).get_job_logs(result["job_id"])
    assert "Found multiple active Ray instances" not in job_logs
    listed = subprocess.run(
        [str(BIN / "trainlab"), "jobs", "--json", "--address", cluster.dashboard_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = {r["job_id"]: r for r in json.loads(listed.stdout.strip().splitlines()[-1])}
    assert rows[result["job_id"]]["status"] == "SUCCEEDED"
    assert any(r["kind"] == "probe" for r in rows.values())  # the reachability check ran
    # The hook variable reached the job's rank 0 (carried encrypted by submit) ...
    assert [a["rule"] for a in hook_server[1]][:1] == ["stale_checkpoint"], hook_server[1]
    # ... and is nowhere in the job's info (runtime env, entrypoint, metadata), its logs,
    # the run directory, the MLflow store or what the commands printed.
    client = _client(cluster)
    records = [repr(client.get_job_info(result["job_id"])), proc.stdout, proc.stderr]
    records.append(client.get_job_logs(result["job_id"]))
    files = [f for f in [*Path(result["run_dir"]).rglob("*"), runs / "mlflow.db"] if f.is_file()]
    leaked = [str(f) for f in files if hook_url.encode() in f.read_bytes()]
    leaked += [r[:80] for r in records if hook_url in r]
    assert not leaked, leaked


# extended (17 s, make test's 30 minutes): the Ray pipeline's byte-for-byte
# equality with the local one is tests/ray/test_prep_ray.py (one node).
@pytest.mark.extended
def test_prep_on_several_nodes_equals_a_single_process_prep(cluster, tmp_path):
    """`trainlab prep` as a driver of this cluster: the work units run on more than
    one node, and the dataset is the one a single process prepares from the same
    inputs, byte for byte (same manifest fingerprint and accounts)."""
    from trainlab.data.prep import run_prep
    from trainlab.rayjobs.localcluster import SINGLE_MACHINE_ENV

    sources = tmp_path / "s.yaml"
    sources.write_text(f"""
train_tokenizer: {{vocab_size: 600}}
shard_target_mb: 0.1
sources:
  - {{name: code, paths: ["{STDLIB}/email/**/*.py", "{STDLIB}/json/*.py", "{STDLIB}/http/*.py",
                          "{STDLIB}/asyncio/*.py", "{STDLIB}/unittest/**/*.py"], format: text}}
  - {{name: more, paths: ["{STDLIB}/xml/**/*.py", "{STDLIB}/email/*.py",
                          "{STDLIB}/idlelib/**/*.py", "{STDLIB}/multiprocessing/**/*.py"], format: text}}
""")
    # Enough units (25; 1 s of tokenizing on 2 workers) that a node's task which
    # starts a moment after another's still finds units to claim: with 6 units
    # (0.3 s) the first task once took them all on a cold machine (unit_nodes 1).
    local = run_prep(sources, tmp_path / "local", executor="local")
    # A driver of the loopback-only cluster, as its nodes are (SINGLE_MACHINE_ENV).
    env = {
        **os.environ,
        **SINGLE_MACHINE_ENV,
        "RAY_ADDRESS": cluster.gcs_address,
        "RAY_AUTH_MODE": "token",
    }
    out = tmp_path / "cluster"
    tokenizer = tmp_path / "local" / "tokenizer.json"
    proc = subprocess.run(
        [str(BIN / "trainlab"), "prep", str(sources), "--out", str(out)]
        + ["--tokenizer", str(tokenizer), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["units_total"] >= 4 and report["units_reused"] == 0
    assert report["unit_nodes"] >= 2  # the units ran on more than one raylet's workers
    assert report["driver_document_bytes"] == 0
    assert report["fingerprint"] == local.manifest["fingerprint"]
    assert report["sources"] == local.manifest["sources"]


def test_plain_ray_job_submit_of_the_entry_script(cluster, dataset, tmp_path):
    """The plain path (docs/cluster.md, cluster/README.md): `ray job submit --working-dir .`
    of the entry script with absolute data and runs paths, as short as a run with
    a checkpoint gets (2 steps, one worker: spanning nodes is tested above): it
    trains and lands in this runs root's MLflow store. (A relative path there is refused in one line: tests/unit/config/test_jobcopy.py.)"""
    runs = tmp_path / "runs"
    job_id = f"plain-{time.time_ns()}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_API_SERVER_ADDRESS": cluster.dashboard_url}
    proc = subprocess.run(
        [
            str(BIN / "ray"),
            "job",
            "submit",
            "--submission-id",
            job_id,
            "--working-dir",
            ".",
            "--runtime-env",
            "cluster/runtime_env.yaml",
            "--",
            "python",
            "trainers/pretrain.py",
            "trainers/recipes/tiny.yaml",
            *_sets([*overrides(dataset, runs, steps=2, every=2), "resource.num_workers=1"]),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    info = _client(cluster).get_job_info(job_id)
    assert str(info.status.value) == "SUCCEEDED", info.message
    run = _mlflow_run(runs, job_id)
    assert run.info.status == "FINISHED"
    (run_dir,) = runs.glob("*/tiny_*")  # named after its --set changes
    assert _summary(run_dir)["status"] == "completed"


@pytest.mark.extended
@pytest.mark.parametrize("loss", ["worker_process", "node"])
def test_a_job_retry_avoids_the_node_that_failed_and_resumes(cluster, dataset, tmp_path, loss):
    """After the first checkpoint, the training worker on a worker node dies: its
    process (SIGKILL; the node stays up and could take the retry's workers) or the
    whole node (its raylet killed). Ray Train has no restarts left
    (train.max_failures=0), so the trainer exits 75 naming that node; the job-level
    retry (resource.job_retries) excludes it, places its workers on the other nodes
    and resumes from the checkpoint."""
    from trainlab.rayjobs import client as jobclient
    from trainlab.rayjobs.localcluster import kill_raylet, node_id
    from trainlab.rayjobs.submit import Submitter, job_runtime_env, prepare, stage_working_dir

    runs = tmp_path / "runs"
    prep = prepare(
        str(REPO / "trainers/recipes/tiny.yaml"),
        [*overrides(dataset, runs, steps=10, every=2), "train.max_failures=0"],
        REPO,
    )
    wd = tmp_path / "wd"
    config_rel = stage_working_dir(prep, wd)
    client = _client(cluster)
    runtime_env = job_runtime_env(REPO, wd)
    sub = Submitter(prep, client, cluster.dashboard_url, runtime_env, config_rel, print)
    job_id = sub.train(retries=1)
    checkpoints = Path(prep.run_dir) / "checkpoints"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not list(checkpoints.glob("step-*")):
        status = str(client.get_job_status(job_id).value)
        assert status not in jobclient.TERMINAL, client.get_job_logs(job_id)[-3000:]
        assert time.monotonic() < deadline, "no checkpoint written"
        time.sleep(1.0)
    ray_job = client.get_job_info(job_id).job_id
    first = [a for a in _train_actors(cluster) if a.get("job_id") == ray_job]
    on_workers = {node_id(n): n for n in cluster.workers if node_alive(n)}
    victim_actor = next(a for a in first if a["node_id"] in on_workers)
    victim_id = victim_actor["node_id"]
    before = {a["actor_id"] for a in _train_actors(cluster)}
    if loss == "node":
        kill_raylet(on_workers[victim_id])  # the node is lost: raylet and every process
    else:
        os.kill(victim_actor["pid"], signal.SIGKILL)  # the worker process only
    info = jobclient.wait_for(client, job_id, timeout_s=JOB_TIMEOUT_S)
    logs = client.get_job_logs(job_id)
    assert str(info.status.value) == "SUCCEEDED", logs[-3000:]
    # The retry said which node it excluded, and why; its workers ran elsewhere.
    assert f"excluding node(s) {victim_id} (lost attempt 1's workers: {victim_id})" in logs
    # The retry is another driver (another Ray job id): its workers are the ones
    # created after the kill.
    retry_nodes = {a["node_id"] for a in _train_actors(cluster) if a["actor_id"] not in before}
    assert retry_nodes and victim_id not in retry_nodes, (victim_id, retry_nodes)
    driver_log = (Path(prep.run_dir) / "logs" / "driver.log").read_text()
    assert f"avoiding node(s) {victim_id}" in driver_log
    summary = _summary(prep.run_dir)
    assert (summary["status"], summary["final_step"]) == ("completed", 10)
    from trainlab.run.records import RunRecords

    starts = [a["start_step"] for a in RunRecords(prep.run_dir).attempts()]
    assert starts[0] == 0 and starts[-1] >= 2  # resumed from a checkpoint, not from scratch
    assert node_alive(on_workers[victim_id]) == (loss == "worker_process")


def node_alive(node) -> bool:
    from trainlab.rayjobs.localcluster import group_members

    return bool(group_members(node.pgid))


def test_refusals_before_submission_and_stop(cluster, dataset, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    trains_before = _train_jobs(cluster)
    missing = tmp_path / "not-prepared"
    proc = subprocess.run(
        [
            str(BIN / "trainlab"),
            "submit",
            "trainers/recipes/tiny.yaml",
            *_sets(
                [*overrides(dataset, tmp_path / "runs", steps=4, every=2), f"data.path={missing}"]
            ),
            "--address",
            cluster.dashboard_url,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    # One line per node, naming the node and the missing manifest.
    alive = [n for n in cluster.nodes if node_alive(n)]
    assert len(errors) == len(alive) and all(f"{missing}/manifest.json" in ln for ln in errors)
    assert _train_jobs(cluster) == trains_before  # nothing was submitted

    # A rehearsal that fails on the cluster (more CPUs per worker than any node
    # has) keeps the real job from being submitted.
    rehearsal = subprocess.run(
        [
            str(BIN / "trainlab"),
            "submit",
            "trainers/recipes/tiny.yaml",
            *_sets(
                [
                    *overrides(dataset, tmp_path / "runs", steps=4, every=2),
                    "resource.cpus_per_worker=8",
                ]
            ),
            "--address",
            cluster.dashboard_url,
            "--smoke-first",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
    )
    assert rehearsal.returncode == 2, rehearsal.stderr[-3000:]
    last = rehearsal.stderr.strip().splitlines()[-1]
    assert last.startswith("error: smoke rehearsal failed") and "CPU" in last
    assert "the real job was not submitted" in last
    assert _train_jobs(cluster) == trains_before

    from trainlab.rayjobs.runtime_env import entrypoint_options

    job_id = _client(cluster).submit_job(
        entrypoint='python -c "import time; time.sleep(600)"', **entrypoint_options()
    )
    stop = subprocess.run(
        [str(BIN / "trainlab"), "stop", job_id, "--json", "--address", cluster.dashboard_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stop.returncode == 0, stop.stderr
    assert json.loads(stop.stdout.strip().splitlines()[-1])["status"] == "STOPPED"
    again = subprocess.run(
        [str(BIN / "trainlab"), "stop", "no-such-job", "--address", cluster.dashboard_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 2 and "no such job" in again.stderr


def _train_jobs(cluster) -> int:
    from trainlab.rayjobs.client import list_jobs

    return sum(r.kind == "train" for r in list_jobs(_client(cluster)))
