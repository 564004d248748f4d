"""Mix-search parsing and trial configs (no Ray)."""

from __future__ import annotations

import math

import pytest

from tests.conftest import RECIPES
from trainlab.config import load_config
from trainlab.errors import UserError
from trainlab.tune import Dimension, absolute_paths, objective, parse_search, trial_config


def test_parse_uniform_and_grid():
    dims = parse_search(["data.mix.code=0.2:0.8", "data.mix.docs=0.1,0.3"])
    assert dims == [Dimension("code", 0.2, 0.8), Dimension("docs", grid=(0.1, 0.3))]


@pytest.mark.parametrize(
    "item, message",
    [
        ("train.lr=1:2", "only mix weights are searched"),
        ("data.mix.=1:2", "expected data.mix.SOURCE"),
        ("data.mix.code=0.8:0.2", "LOW must be < HIGH"),
        ("data.mix.code=a:b", "must be numbers"),
        ("data.mix.code=0,1", "finite and > 0"),
    ],
)
def test_parse_rejects_bad_specs(item, message):
    with pytest.raises(UserError, match=message):
        parse_search([item])


def test_parse_rejects_a_source_searched_twice():
    with pytest.raises(UserError, match="searched twice"):
        parse_search(["data.mix.code=1,2", "data.mix.code=2,3"])


def test_trial_config_changes_only_the_mix_and_name(tmp_path, monkeypatch):
    base = load_config(RECIPES / "tiny.yaml")
    d = absolute_paths(base)
    assert d["data"]["path"].startswith("/") and d["train"]["runs_root"].startswith("/")
    trial = trial_config(d, {"code": 0.123456, "docs": 0.3, "pkgdocs": 0.2}, "tiny-mix-a")
    assert trial.name == "tiny-mix-a" and trial.data.mix["code"] == 0.1235
    assert trial.model == base.model and trial.train == base.train.model_copy(
        update={"runs_root": d["train"]["runs_root"]}
    )
    assert trial.tracking.experiment == base.tracking.experiment


def test_objective_reads_run_summaries():
    s = {"val_loss": 2.5, "final_loss": 3.0, "val_losses": {"code": 2.0}}
    assert objective(s, "val_loss") == 2.5 and objective(s, "final_loss") == 3.0
    assert objective(s, "val_loss/code") == 2.0
    assert math.isinf(objective({"val_loss": None}, "val_loss"))
