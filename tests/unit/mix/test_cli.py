"""`trainlab mix fit|propose --json` on a synthetic swarm record: the exact JSON
shapes of the issue's interface, as the last stdout line of a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.mix.synthetic import make_record
from trainlab.config import ExperimentConfig
from trainlab.errors import UserError
from trainlab.mix.swarm import reusable_trials

REPO = Path(__file__).resolve().parents[3]


def trainlab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainlab", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MLFLOW_TRACKING_URI": ""})


def last_json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_fit_and_propose_json_shapes(tmp_path):
    rec = make_record(tmp_path, n=16)
    root = str(tmp_path / "runs")
    fit = last_json(trainlab("mix", "fit", rec["swarm_id"], "--target", "val_loss/code",
                             "--runs-root", root, "--json"))
    assert {"swarm_id", "target", "n_runs", "models", "best_model"} <= set(fit)
    assert fit["swarm_id"] == rec["swarm_id"] and fit["target"] == "val_loss/code"
    assert fit["n_runs"] == 16 and fit["best_model"] in fit["models"]
    for m in fit["models"].values():
        assert set(m) == {"spearman_cv", "rmse_cv"}
        assert isinstance(m["spearman_cv"], float) and isinstance(m["rmse_cv"], float)

    out = tmp_path / "prop.yaml"
    prop = last_json(trainlab("mix", "propose", rec["swarm_id"], "--target", "val_loss/code",
                              "--min", "0.05", "--max", "0.7", "--out", str(out),
                              "--runs-root", root, "--json"))
    assert {"swarm_id", "target", "mix", "predicted", "predicted_interval",
            "swarm_cost_fraction"} <= set(prop)
    assert set(prop["mix"]) == set(rec["sources"])
    assert sum(prop["mix"].values()) == pytest.approx(1.0, abs=1e-6)
    assert all(0.05 - 1e-9 <= w <= 0.7 + 1e-9 for w in prop["mix"].values())
    lo, hi = prop["predicted_interval"]
    assert lo <= hi and isinstance(prop["predicted"], float)
    assert prop["swarm_cost_fraction"] == pytest.approx(rec["cost"]["flops_fraction"])
    assert prop["recipe"] == str(out) and out.exists()
    # Recorded in the swarm record for later commands.
    saved = json.loads((tmp_path / "runs" / "mix" / rec["swarm_id"] / "swarm.json").read_text())
    assert "val_loss/code" in saved["fits"] and saved["proposals"][-1]["mix"] == prop["mix"]


def test_unknown_swarm_and_bad_target_exit_2_with_one_line(tmp_path):
    make_record(tmp_path, n=8)
    root = str(tmp_path / "runs")
    r = trainlab("mix", "fit", "deadbeef", "--runs-root", root, "--json")
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and "0123abcd" in r.stderr
    r = trainlab("mix", "propose", "0123abcd", "--target", "val_loss/web", "--runs-root", root)
    assert r.returncode == 2 and "no source 'web'" in r.stderr


def test_reuse_takes_completed_runs_of_the_same_proxy_with_new_sources_at_zero(tmp_path):
    old = make_record(tmp_path, n=6, tokens={"code": 1_000_000, "docs": 400_000})
    old["trials"][0]["status"] = "failed"
    proxy = ExperimentConfig.model_validate(old["proxy_config"])
    got = reusable_trials(old, proxy, ["code", "docs", "pkgdocs"])
    assert len(got) == 5 and all(t["reused_from"] == old["swarm_id"] for t in got)
    assert all(t["mix"]["pkgdocs"] == 0.0 and t["mix"]["code"] > 0 for t in got)
    other = proxy.model_copy(update={"train": proxy.train.model_copy(update={"lr": 1e-4})})
    with pytest.raises(UserError, match="train.lr"):
        reusable_trials(old, other, ["code", "docs", "pkgdocs"])
    with pytest.raises(UserError, match="reuse is for adding sources"):
        reusable_trials(old, proxy, ["code", "pkgdocs"])


def test_confirm_reads_the_proposal_sidecar_and_parses_baselines(tmp_path):
    from trainlab.mix.api import run_propose
    from trainlab.mix.confirm import _configs, baseline_mix, load_proposal

    rec = make_record(tmp_path, n=8)
    out = tmp_path / "p.yaml"
    run_propose(rec["swarm_id"], "val_loss", model="loglinear", out=str(out),
                runs_root=str(tmp_path / "runs"), log=False)
    prop = load_proposal(out)
    assert prop["swarm_id"] == rec["swarm_id"] and prop["recipe"] == str(out.resolve())
    with pytest.raises(UserError, match="no missing.proposal.json"):
        load_proposal(tmp_path / "missing.yaml")
    assert baseline_mix("base", rec, prop)[1] == {"code": 0.5, "docs": 0.3, "pkgdocs": 0.2}
    natural = baseline_mix("natural", rec, prop)[1]
    assert natural == pytest.approx({"code": 0.5882, "docs": 0.2353, "pkgdocs": 0.1765}, abs=1e-4)
    assert baseline_mix("best", rec, prop)[1] == pytest.approx(prop["best_trial"]["mix"], abs=1e-4)
    assert baseline_mix("code=3,docs=1", rec, prop)[1] == {"code": 0.75, "docs": 0.25}
    for bad in ("code=x", "web=1", "code=-1"):
        with pytest.raises(UserError, match="--against"):
            baseline_mix(bad, rec, prop)
    runs = _configs(rec["target_config"], prop["mix"], "tiny-c", 2, "exp")
    assert [r["train"]["seed"] for r in runs] == [0, 1] and runs[1]["data"]["seed"] == 1235
    assert {r["tracking"]["experiment"] for r in runs} == {"exp"}
    assert runs[0]["data"]["mix"] == prop["mix"] and runs[0]["name"] == "tiny-c-r0"


def test_confirm_records_each_arms_repeats_as_a_group_compare_reads(tmp_path):
    """`mix confirm --repeats K`: each arm's seeds tagged as a group in the real
    MLflow store, so `trainlab compare` of the two groups gives the bands and the
    gap with its interval and verdict (here the runs are recorded by hand: no
    training)."""
    from trainlab.mix.confirm import _configs, tag_group
    from trainlab.track.backend import client_for, get_or_create_experiment, tracking_uri
    from trainlab.track.mlflow_cb import run_key
    from trainlab.track.noise import LARGER
    from trainlab.track.query import compare_report

    rec = make_record(tmp_path, n=8)
    runs_root = tmp_path / "runs"
    uri = tracking_uri(runs_root)
    client = client_for(uri)
    exp = get_or_create_experiment(client, "exp", None)
    arms = {}
    for arm, mix, losses in (("proposal", {"code": 0.7, "docs": 0.3}, (3.10, 3.12, 3.11)),
                             ("baseline", {"code": 0.5, "docs": 0.5}, (3.40, 3.43, 3.41))):
        configs = _configs(rec["target_config"], mix, f"tiny-c-{arm}", 3, "exp")
        rows = []
        for cfg, loss in zip(configs, losses, strict=True):
            run_dir = str(runs_root / "2026-12-05" / cfg["name"])
            run = client.create_run(exp, run_name=cfg["name"],
                                    tags={"run_key": run_key(run_dir)})
            client.log_param(run.info.run_id, "name", cfg["name"])
            client.log_metric(run.info.run_id, "val_loss/all", loss, step=60)
            client.set_terminated(run.info.run_id)
            rows.append({"run_dir": run_dir})
        rows.append({"run_dir": None})  # a trial that left no record is left out
        arms[arm] = tag_group(uri, exp, configs[0], rows)
    report = compare_report(uri, [arms["baseline"], arms["proposal"]])
    bands = {g["group_id"]: g["metrics"]["val_loss"] for g in report["groups"]}
    assert bands[arms["proposal"]]["n"] == bands[arms["baseline"]]["n"] == 3
    assert bands[arms["proposal"]]["mean"] == pytest.approx(3.11)
    (c,) = report["comparisons"]
    assert abs(c["metrics"]["val_loss"]["difference"]) == pytest.approx(3.4133 - 3.11, abs=1e-3)
    assert c["metrics"]["val_loss"]["verdict"] == LARGER
