"""The noise statistics of `trainlab compare` (trainlab.track.noise) against
scipy's own Welch test and the textbook prediction interval, and the grouping of
compare's rows into groups and single runs."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from trainlab.repeats import experiment_key
from trainlab.track import noise

A = [3.10, 3.20, 3.05]
B = [3.50, 3.62, 3.44, 3.55]


def test_group_band_is_mean_sample_sd_and_n():
    b = noise.band([*A, None])
    assert b["n"] == 3 and b["mean"] == pytest.approx(sum(A) / 3)
    assert b["std"] == pytest.approx(stats.tstd(A))
    assert noise.band([3.0]) == {"mean": 3.0, "std": None, "n": 1}


def test_two_groups_use_welchs_interval():
    r = noise.welch(noise.band(A), noise.band(B))
    ci = stats.ttest_ind(B, A, equal_var=False).confidence_interval(0.95)
    assert r["difference"] == pytest.approx(sum(B) / 4 - sum(A) / 3)
    assert r["interval"] == pytest.approx([ci.low, ci.high])
    assert r["verdict"] == noise.LARGER
    close = noise.welch(noise.band(A), noise.band([3.12, 3.18, 3.02]))
    assert close["interval"][0] < 0 < close["interval"][1] and close["verdict"] == noise.WITHIN


def test_a_run_against_a_group_uses_the_prediction_interval_of_one_more_seed():
    g = noise.band(A)
    r = noise.run_vs_group(3.4, g)
    half = stats.t.ppf(0.975, 2) * g["std"] * math.sqrt(1 + 1 / 3)
    assert r["difference"] == pytest.approx(3.4 - g["mean"])
    assert r["interval"] == pytest.approx([r["difference"] - half, r["difference"] + half])
    assert noise.run_vs_group(3.4, noise.band([3.1]))["verdict"] == noise.UNKNOWN


def _row(name, val, group=None, key="k"):
    return {
        "name": name,
        "val_loss": val,
        "best_val_loss": val,
        "final_loss": val,
        "group_id": group,
        "experiment_key": key,
        "params": {"name": name},
    }


def test_report_groups_rows_and_compares_against_the_oldest():
    rows = [
        _row("b2", 3.5, "gb"),
        _row("b1", 3.6, "gb"),
        _row("a2", 3.1, "ga"),
        _row("a1", 3.2, "ga"),
    ]  # newest first, as compare lists them
    report = noise.noise_report(rows)
    assert [g["group_id"] for g in report["groups"]] == ["ga", "gb"]
    (c,) = report["comparisons"]
    assert (c["a"], c["b"]) == ("group ga", "group gb")
    assert c["metrics"]["val_loss"]["difference"] == pytest.approx(0.4)


def test_two_single_runs_borrow_a_recorded_band_or_say_none_is_known():
    rows = [_row("new", 3.3), _row("old", 3.1)]
    none = noise.noise_report(rows)["comparisons"][0]
    assert none["noise_from"] is None and none["metrics"]["val_loss"]["verdict"] == noise.UNKNOWN
    recorded = {
        "k": noise.group_summary(
            {"group_id": "g", "rows": [_row(f"s{i}", v, "g") for i, v in enumerate(A)]}
        )
    }
    c = noise.noise_report(rows, recorded)["comparisons"][0]
    half = stats.t.ppf(0.975, 2) * stats.tstd(A) * math.sqrt(2)
    assert c["noise_from"] == "g"
    assert c["metrics"]["val_loss"]["interval"] == pytest.approx([0.2 - half, 0.2 + half])


def test_the_experiment_key_ignores_seeds_and_names_not_the_lr():
    base = {"name": "tiny", "data.seed": 1234, "train.seed": 0, "train.lr": 0.001}
    assert experiment_key(base) == experiment_key({**base, "name": "x", "data.seed": "1235"})
    assert experiment_key(base) != experiment_key({**base, "train.lr": "0.003"})
