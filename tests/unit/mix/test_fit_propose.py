"""Fit and propose on synthetic swarms whose law is known: the fit ranks the
trials, and the proposal recovers the law's constrained optimum."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from tests.unit.mix.synthetic import SOURCES, make_record
from trainlab.config import load_config
from trainlab.errors import UserError
from trainlab.mix.api import run_fit, run_propose
from trainlab.mix.fit import MODELS, fit_swarm
from trainlab.mix.sampling import feasibility
from trainlab.mix.swarm import budget
from trainlab.mix.targets import parse_target

T_LOGLINEAR = {"code": -1.0, "docs": 0.5, "pkgdocs": 0.2}


def loglinear_law(w: dict[str, float]) -> dict[str, float]:
    v = math.exp(1.5 + sum(T_LOGLINEAR[s] * w[s] for s in SOURCES))
    return {"val_loss": v, **{f"val_loss/{s}": v for s in SOURCES}}


OPT = {"code": 0.5, "docs": 0.2, "pkgdocs": 0.3}


def bowl_law(w: dict[str, float]) -> dict[str, float]:
    v = 4.0 + 6.0 * sum((w[s] - OPT[s]) ** 2 for s in SOURCES)
    return {"val_loss": v, **{f"val_loss/{s}": v for s in SOURCES}}


def test_fit_reports_cross_validated_quality_per_model_and_sensitivities(tmp_path):
    rec = make_record(tmp_path, n=24)
    fit = fit_swarm(rec, parse_target("val_loss/docs"))
    assert set(fit["models"]) == set(MODELS) and fit["n_runs"] == 24
    best = fit["models"][fit["best_model"]]
    assert best["spearman_cv"] > 0.9 and best["rmse_cv"] < 0.1
    # More docs lowers the docs loss; moving toward another source raises it.
    s = fit["sensitivities"]
    assert s["docs"] < 0 < s["code"] and s["pkgdocs"] > 0


def test_a_fit_of_noise_is_reported_as_no_rank_correlation(tmp_path):
    rng = np.random.default_rng(0)
    rec = make_record(tmp_path, law=lambda w: {"val_loss": 5.0 + rng.normal(0, 0.1)}, n=24,
                      noise=0.0)
    fit = fit_swarm(rec, parse_target("val_loss"), ("loglinear",))
    assert abs(fit["models"]["loglinear"]["spearman_cv"]) < 0.5


def test_propose_recovers_the_vertex_optimum_of_a_loglinear_law_within_bounds(tmp_path):
    rec = make_record(tmp_path, law=loglinear_law, n=20, noise=0.001)
    p = run_propose(rec["swarm_id"], "val_loss", high=0.6, model="loglinear",
                    runs_root=str(tmp_path / "runs"), log=False)
    # Lowest slope first: code at its bound, then pkgdocs; docs at the floor.
    assert p["mix"] == pytest.approx({"code": 0.6, "docs": 0.01, "pkgdocs": 0.39}, abs=0.01)
    assert sum(p["mix"].values()) == pytest.approx(1.0, abs=1e-9)
    true = loglinear_law(p["mix"])["val_loss"]
    assert p["predicted"] == pytest.approx(true, rel=0.01)
    lo, hi = p["predicted_interval"]
    assert lo <= p["predicted"] <= hi and hi - lo < 0.05


def test_propose_recovers_an_interior_optimum(tmp_path):
    rec = make_record(tmp_path, law=bowl_law, n=30, noise=0.002)
    p = run_propose(rec["swarm_id"], "val_loss", runs_root=str(tmp_path / "runs"), log=False)
    assert p["model"] == "quadratic"
    assert p["mix"] == pytest.approx(OPT, abs=0.04)
    best_trial = min(bowl_law(t["mix"])["val_loss"] for t in rec["trials"])
    assert bowl_law(p["mix"])["val_loss"] <= best_trial


def test_proposal_respects_the_target_runs_repetition_cap_and_writes_a_recipe(tmp_path):
    # docs: 12,288 training tokens; the 60-step tiny target reads 122,880 tokens, so at
    # 10 epochs docs may have at most 1.0 share... at 2 epochs (set below) 0.2.
    tokens = {"code": 1_000_000, "docs": 12_288, "pkgdocs": 300_000}
    rec = make_record(tmp_path, law=loglinear_law, n=20, tokens=tokens,
                      overrides=("data.max_epochs_per_source=2",))
    T_LOGLINEAR["docs"] = -3.0  # now docs is what the law wants most
    try:
        rec = make_record(tmp_path, law=loglinear_law, n=20, tokens=tokens,
                          overrides=("data.max_epochs_per_source=2",))
        out = tmp_path / "recipes" / "tiny-mix.yaml"
        p = run_propose(rec["swarm_id"], "val_loss", model="loglinear", out=str(out),
                        runs_root=str(tmp_path / "runs"), log=False)
    finally:
        T_LOGLINEAR["docs"] = 0.5
    target_cfg = load_config(out)
    cap = 2.0 * 12_288 / (60 * 16 * 128)
    assert p["mix"]["docs"] <= cap + 1e-4 and p["mix"]["docs"] > cap - 0.01
    assert feasibility(p["mix"], tokens, budget(target_cfg)) is None
    # The recipe extends the swarm's config, keeps its --set overrides, sets the mix.
    raw = yaml.safe_load(out.read_text())
    assert raw["extends"].endswith("tiny.yaml") and raw["data"]["max_epochs_per_source"] == 2
    assert target_cfg.data.mix == p["mix"] and target_cfg.name == "tiny-mix"
    assert (tmp_path / "recipes" / "tiny-mix.proposal.json").exists()


def test_propose_refuses_bounds_no_mixture_meets(tmp_path):
    rec = make_record(tmp_path, n=8)
    with pytest.raises(UserError, match="no mixture fits these bounds"):
        run_propose(rec["swarm_id"], "val_loss", low=0.4, runs_root=str(tmp_path / "runs"),
                    log=False)
    with pytest.raises(UserError, match="--model 'svm'"):
        run_fit(rec["swarm_id"], "val_loss", "svm", str(tmp_path / "runs"), log=False)
