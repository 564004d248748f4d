"""An elastic run on a real multi-node Ray cluster on this machine (`trainlab cluster
up --worker-nodes 2`: a head and two more raylets, 3 logical CPUs each, every
training worker taking 2, so each node hosts one worker):

- a 3-worker elastic run (`resource.num_workers: {min: 2, max: 3}`) loses a worker's
  node at step 5 (`train.chaos.kill_node_at_steps`: that node's raylet is killed),
  continues at 2 workers without waiting for a replacement, grows back to 3 once
  `trainlab cluster add-node` brings capacity back, and ends at the final loss of
  an uninterrupted fixed-size run of the same config (fp32, train.deterministic;
  trained on 3 local processes by the same Trainer) within 1e-4 relative;
- the resizes are in run_summary.json, logs/attempts.jsonl and the MLflow run.

In `make test`: about 4 minutes on 2 cores (figures in docs/elastic.md). While
the run is below its maximum its steps are paced (tests/e2e/elastic_components.py),
so the returning node finds it still training however fast the machine is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
JOB_TIMEOUT_S = 900
STEPS = 40
KILL_AT = 5


@pytest.fixture(scope="module")
def trainlab_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("trainlab-home")
    saved = os.environ.get("TRAINLAB_HOME")
    os.environ["TRAINLAB_HOME"] = str(home)
    yield home
    if saved is None:
        os.environ.pop("TRAINLAB_HOME", None)
    else:
        os.environ["TRAINLAB_HOME"] = saved


def _trainlab(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "trainlab"), *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def cluster(trainlab_home):
    import shutil

    from trainlab.rayjobs.localcluster import ClusterState, read_state

    up = _trainlab(
        "cluster", "up", "--num-cpus=3", "--worker-nodes=2", "--worker-cpus=3", "--json",
        timeout=900,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr[-3000:]
    state = ClusterState.from_json(json.loads(up.stdout.strip().splitlines()[-1]))
    yield state
    nodes = (read_state() or state).nodes  # add-node's too
    down = _trainlab("cluster", "down")
    assert down.returncode == 0, down.stderr
    for node in nodes:
        shutil.rmtree(node.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from devtools.datasets import write_stdlib_dataset

    root = tmp_path_factory.mktemp("prepared")
    write_stdlib_dataset(root, code_docs=60, prose_docs=200, vocab_size=2048)
    return root


def _overrides(dataset: Path, runs: Path) -> list[str]:
    return [
        f"data.path={dataset}",
        "data.mix={code: 0.6, docs: 0.4}",
        "data.micro_batch_size=2",
        "data.global_batch_size=12",  # dp 3: 2 micro batches; dp 2: 3
        "model.vocab_size=2048",
        "resource.cpus_per_worker=2",
        f"train.runs_root={runs}",
        f"train.total_steps={STEPS}",
        "train.warmup_steps=2",
        "train.log_interval=1",
        "train.eval_interval=2",
        "train.eval_batches=1",
        "train.checkpoint.every_steps=2",
        "train.deterministic=true",
        "train.max_failures=5",
        "tracking.system_metrics=false",
    ]


def _submit(cluster, sets: list[str], tmp: Path):
    from trainlab.rayjobs.client import connect
    from trainlab.rayjobs.submit import Submitter, job_runtime_env, prepare, stage_working_dir

    prep = prepare(str(REPO / "trainers/recipes/tiny.yaml"), sets, REPO)
    wd = tmp / "wd"
    config_rel = stage_working_dir(prep, wd)
    client = connect(cluster.dashboard_url)
    runtime_env = job_runtime_env(REPO, wd)
    sub = Submitter(prep, client, cluster.dashboard_url, runtime_env, config_rel, print)
    return client, sub.train(retries=0), Path(prep.run_dir)


def _reference(dataset: Path, tmp: Path) -> dict:
    """The summary of the uninterrupted fixed-size run (3 workers) of the test's
    config, on 3 local processes (tests/unit/train/layout_runner.py)."""
    from tests.train_helpers import make_job
    from tests.unit.train.layout_runner import run_layout
    from trainlab.config import load_config

    sets = [*_overrides(dataset, tmp / "ref-runs"), "resource.num_workers=3", "name=reference"]
    cfg = load_config(str(REPO / "trainers/recipes/tiny.yaml"), sets)
    _, summary = run_layout(make_job(cfg, tmp / "ref"), 3, tmp / "ref.json")
    return summary


def _wait(client, job_id: str):
    from trainlab.rayjobs import client as jobclient

    info = jobclient.wait_for(client, job_id, timeout_s=JOB_TIMEOUT_S)
    assert str(info.status.value) == "SUCCEEDED", client.get_job_logs(job_id)[-4000:]


def test_an_elastic_run_shrinks_on_a_lost_node_grows_back_and_trains_the_same_model(
    cluster, dataset, tmp_path
):
    from trainlab.rayjobs import client as jobclient
    from trainlab.run.records import RunRecords

    runs = tmp_path / "runs"
    base = _overrides(dataset, runs)
    # The reference: the same experiment at a fixed 3 workers, nothing lost, trained
    # by the same Trainer on 3 local gloo processes (25 s; through a Ray job it took
    # 80: what is compared is the model, not the start-up).
    t0 = time.monotonic()
    reference = _reference(dataset, tmp_path)
    ref_seconds = time.monotonic() - t0
    assert reference["status"] == "completed" and reference["final_step"] == STEPS

    elastic = [
        *base,
        "resource.num_workers.min=2",
        "resource.num_workers.max=3",
        "resource.resize_check_s=2",
        f"train.chaos.kill_node_at_steps=[{KILL_AT}]",
        "train.components=[tests.e2e.elastic_components:pace_below_three]",
        "name=elastic",
    ]
    t0 = time.monotonic()
    client, job_id, run_dir = _submit(cluster, elastic, tmp_path / "elastic")
    records = RunRecords(run_dir)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not any(r["to_world_size"] == 2 for r in records.resizes()):  # continued at 2
        status = str(client.get_job_status(job_id).value)
        assert status not in jobclient.TERMINAL, client.get_job_logs(job_id)[-4000:]
        assert time.monotonic() < deadline, "the run did not continue at 2 workers"
        time.sleep(0.5)
    t_add = time.monotonic()
    added = _trainlab("cluster", "add-node", "--num-cpus=3", "--json")  # capacity returns
    t_added = time.monotonic()
    assert added.returncode == 0, added.stderr[-3000:]
    node = json.loads(added.stdout.strip().splitlines()[-1])["node"]
    assert node["role"] == "worker" and node["num_cpus"] == 3
    while len(records.resizes()) < 2:  # grown back (or the job ended without it)
        if str(client.get_job_status(job_id).value) in jobclient.TERMINAL:
            break
        time.sleep(0.5)
    t_grown = time.monotonic()
    _wait(client, job_id)
    elastic_seconds = time.monotonic() - t0

    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == STEPS
    resizes = summary["resizes"]
    print(
        json.dumps({
            "resizes": resizes, "reference_s": ref_seconds, "elastic_s": elastic_seconds,
            "add_node_s": t_added - t_add, "added_to_grown_s": t_grown - t_added,
        })
    )  # fmt: skip
    assert [(r["from_world_size"], r["to_world_size"], r["reason"]) for r in resizes] == [
        (3, 2, "node lost"),
        (2, 3, "capacity returned"),
    ], (resizes, client.get_job_logs(job_id)[-6000:])
    shrink, grow = resizes
    assert shrink["step"] <= KILL_AT and shrink["steps_redone"] == KILL_AT - shrink["step"]
    assert shrink["seconds"] > 0 and grow["step"] > shrink["step"]
    assert grow["steps_redone"] == 0  # grown at a checkpoint the ranks held at
    # attempts.jsonl: the sizes of the starts, and dp with them (tp = pp = 1).
    sizes = [(a["world_size"], a["layout"]["dp"]) for a in records.attempts()]
    assert sizes[0] == (3, 3) and (2, 2) in sizes and sizes[-1] == (3, 3), sizes
    # The same model: the final loss of the uninterrupted run, within 1e-4 relative.
    rel = abs(summary["final_loss"] - reference["final_loss"]) / abs(reference["final_loss"])
    assert rel < 1e-4, (summary["final_loss"], reference["final_loss"], rel)
    # The MLflow run has the resizes as metrics at their steps.
    import mlflow

    store = mlflow.MlflowClient(tracking_uri=f"sqlite:///{runs}/mlflow.db")
    exps = [e.experiment_id for e in store.search_experiments()]
    (run,) = [r for r in store.search_runs(exps) if r.data.tags.get("ray_job_id") == job_id]
    history = store.get_metric_history(run.info.run_id, "resize/to_world_size")
    assert sorted((m.step, m.value) for m in history) == [
        (shrink["step"], 2.0),
        (grow["step"], 3.0),
    ]


@pytest.mark.extended
def test_below_min_after_a_loss_the_attempt_fails_with_the_reason(cluster, dataset, tmp_path):
    """A range whose min is every node this cluster has ({min: 3, max: 4}, one worker
    per raylet) loses a node: the restart cannot place 3, and after
    `resource.below_min_wait_s` the attempt fails, saying why (a job retry would
    then apply), instead of waiting for ever as Ray's own policy does.

    extended: 83 s on 2 cores, which make test's 30 minutes no longer hold; the
    policy's decision (wait, then TooFewWorkers naming the minimum and the wait)
    is tests/unit/train/test_growth.py, in make test."""
    from trainlab.rayjobs import client as jobclient

    runs = tmp_path / "runs"
    sets = [
        *_overrides(dataset, runs),
        "data.global_batch_size=24",  # dp 3: 4 micro batches; dp 4: 3
        "train.total_steps=40",
        "resource.num_workers.min=3",
        "resource.num_workers.max=4",
        "resource.below_min_wait_s=5",
        "train.chaos.kill_node_at_steps=[3]",
        "name=below-min",
    ]
    t0 = time.monotonic()
    client, job_id, run_dir = _submit(cluster, sets, tmp_path / "below-min")
    info = jobclient.wait_for(client, job_id, timeout_s=JOB_TIMEOUT_S)
    logs = client.get_job_logs(job_id)
    assert str(info.status.value) == "FAILED", logs[-4000:]
    summary = json.loads((run_dir / "run_summary.json").read_text())
    print(json.dumps({"seconds": time.monotonic() - t0, "summary": summary}))
    assert summary["status"] == "failed" and summary["final_step"] < 40
    assert summary["error"] == (
        "fewer than resource.num_workers.min = 3 workers could be placed for 5 s "
        "after a loss (resource.below_min_wait_s)"
    ), summary["error"]
    assert summary["error"] in logs  # said where the user looks, too
