"""A job retry avoids the nodes blamed for the failure: the wrapper reads the
trainer's `lost_nodes`, says which nodes it excludes and hands them to the
re-run, whose Ray Train workers get a label selector against them (real
processes and Ray's own protobuf records; the cluster test is
tests/e2e/test_cluster_submit.py)."""

from __future__ import annotations

import subprocess
import sys

from ray.core.generated import common_pb2

from trainlab.rayjobs.retry import blamed_in, run_dir_of
from trainlab.train.driver.placement import EXCLUDE_ENV, _blamed, excluded_nodes, node_selector

# Fails like a trainer whose workers were lost on the nodes named in argv (exit 75,
# run_summary.json naming them) until it has seen every one excluded.
CHILD = r"""
import json, os, sys
from pathlib import Path
run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
plan = sys.argv[1].split(";")  # the nodes lost by each attempt
log = run_dir / "seen.txt"
seen = log.read_text().splitlines() if log.exists() else []
seen.append(os.environ.get("TRAINLAB_EXCLUDE_NODES", ""))
log.write_text("\n".join(seen) + "\n")
attempt = len(seen)
if attempt <= len(plan):
    lost = [n for n in plan[attempt - 1].split(",") if n]
    (run_dir / "run_summary.json").write_text(json.dumps({"status": "failed", "lost_nodes": lost}))
    sys.exit(75)
"""


def test_each_retry_excludes_every_node_blamed_so_far(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainlab.rayjobs.retry",
            "--retries=3",
            "--pause=0",
            "--",
            sys.executable,
            str(script),
            "aaa;;bbb,aaa",  # attempt 1 loses aaa, 2 nothing, 3 bbb (and aaa again)
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "seen.txt").read_text().splitlines() == ["", "aaa", "aaa", "aaa,bbb"]
    said = [ln for ln in proc.stderr.splitlines() if "[trainlab retry]" in ln]
    assert "excluding node(s) aaa (lost attempt 1's workers: aaa)" in said[0]
    assert said[1].endswith("excluding node(s) aaa")  # nothing new blamed
    assert "excluding node(s) aaa, bbb (lost attempt 3's workers: bbb)" in said[2]


def test_no_blame_no_exclusion(tmp_path):
    assert blamed_in(None) == [] and blamed_in(tmp_path) == []
    (tmp_path / "run_summary.json").write_text('{"status": "failed"}')
    assert blamed_in(tmp_path) == []
    assert node_selector({}) is None and excluded_nodes({EXCLUDE_ENV: " , "}) == []


def test_label_selector_keeps_workers_off_the_excluded_nodes():
    env = {EXCLUDE_ENV: "bb11,aa22,bb11"}
    assert excluded_nodes(env) == ["aa22", "bb11"]
    selector = node_selector(env)
    assert selector == {"ray.io/node-id": "!in(aa22,bb11)"}
    # Ray's own validation of label selectors accepts it, with real (56 hex) node ids
    from ray._private.label_utils import validate_label_selector

    ids = ",".join(["0123456789abcdef" * 3 + "01234567", "f" * 56])
    assert validate_label_selector(node_selector({EXCLUDE_ENV: ids})) is None
    assert validate_label_selector({"ray.io/node-id": "!in(a,)"}) is not None  # it checks


def test_run_dir_of_a_trainer_command():
    assert run_dir_of(["python", "t.py", "c.yaml", "--run-dir", "/r/a b"]) == "/r/a b"
    assert run_dir_of(["python", "t.py", "--run-dir=/r/x"]) == "/r/x"
    assert run_dir_of(["t.py", "--run-dir", "s3://b/runs/d/n"]) == "s3://b/runs/d/n"
    assert run_dir_of(["python", "t.py", "c.yaml"]) is None


def _actor(state: str, reason: str | None = None, oom: bool = False) -> dict:
    cause = common_pb2.ActorDeathCause()
    if oom:
        cause.oom_context.error_message = "killed by the memory monitor"
    elif reason is not None:
        cause.actor_died_error_context.reason = common_pb2.ActorDiedErrorContext.Reason.Value(
            reason
        )
    return {"State": state, "DeathCause": cause if (reason or oom) else None}


def test_blame_falls_on_failed_workers_not_on_those_ray_train_stopped():
    assert _blamed(_actor("DEAD", "NODE_DIED"))
    assert _blamed(_actor("DEAD", "WORKER_DIED"))
    assert _blamed(_actor("DEAD", oom=True))
    assert not _blamed(_actor("DEAD", "RAY_KILL"))  # Ray Train shut the group down
    assert not _blamed(_actor("DEAD", "OUT_OF_SCOPE"))
    assert not _blamed(_actor("ALIVE"))
    assert not _blamed(_actor("DEAD"))
