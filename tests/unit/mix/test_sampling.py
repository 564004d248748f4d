"""Which mixtures a swarm trains: Dirichlet around the natural shares, caps, targets."""

from __future__ import annotations

import numpy as np
import pytest

from trainlab.errors import UserError
from trainlab.mix.sampling import Budget, feasibility, natural_shares, sample_mixtures, share_caps
from trainlab.mix.targets import parse_target, trial_metrics

TOKENS = {"code": 1_000_000, "docs": 200_000, "pkgdocs": 300_000}
BUDGET = Budget(seq_len=128, total_rows=320, total_steps=40, max_epochs=10.0)


def test_samples_are_feasible_mixtures_with_uniform_and_corners_first():
    s = sample_mixtures(TOKENS, 16, BUDGET, concentration=5.0, seed=3)
    assert len(s.mixes) == 16 and s.rejected == 0
    assert s.kinds[:4] == ["uniform", "corner:code", "corner:docs", "corner:pkgdocs"]
    for mix in s.mixes:
        assert list(mix) == list(TOKENS)
        assert sum(mix.values()) == pytest.approx(1.0, abs=2e-4)
        assert min(mix.values()) >= 0.0099
        assert feasibility(mix, TOKENS, BUDGET) is None
    assert s.mixes == sample_mixtures(TOKENS, 16, BUDGET, concentration=5.0, seed=3).mixes
    assert s.mixes != sample_mixtures(TOKENS, 16, BUDGET, concentration=5.0, seed=4).mixes


def test_dirichlet_draws_centre_on_the_natural_shares_and_concentration_sets_the_spread():
    natural = np.array(list(natural_shares(TOKENS).values()))
    wide = np.array([list(m.values()) for m in
                     sample_mixtures(TOKENS, 400, BUDGET, concentration=2.0, special=False).mixes])
    narrow = np.array([list(m.values()) for m in
                       sample_mixtures(TOKENS, 400, BUDGET, concentration=50.0, special=False).mixes])
    assert np.abs(narrow.mean(axis=0) - natural).max() < 0.02
    assert np.abs(wide.mean(axis=0) - natural).max() < 0.05
    assert wide.std(axis=0).min() > 2 * narrow.std(axis=0).max()


def test_samples_over_the_repetition_cap_are_rejected_and_reported():
    small = {"code": 1_000_000, "docs": 8_000}  # docs: 10 epochs = 80k tokens of 40,960 x ...
    budget = Budget(seq_len=128, total_rows=2000, total_steps=200, max_epochs=2.0)
    cap = share_caps(small, budget)["docs"]
    assert cap == pytest.approx(2.0 * 8_000 / (128 * 2000))
    s = sample_mixtures(small, 12, budget, concentration=1.0, seed=0)
    assert s.rejected > 0 and s.rejected_examples
    assert "data.max_epochs_per_source" in s.rejected_examples[0]["reason"]
    assert all(m["docs"] <= cap + 1e-3 for m in s.mixes)
    with pytest.raises(UserError, match="meet data.max_epochs_per_source"):
        sample_mixtures({"code": 1_000_000, "docs": 100}, 4, budget, seed=0)


def test_bad_sampling_arguments_are_user_errors():
    with pytest.raises(UserError, match="--runs"):
        sample_mixtures(TOKENS, 0, BUDGET)
    with pytest.raises(UserError, match="--concentration"):
        sample_mixtures(TOKENS, 4, BUDGET, concentration=0)
    with pytest.raises(UserError, match="at least 2 sources"):
        sample_mixtures({"code": 10}, 4, BUDGET)


def test_targets_parse_and_combine_recorded_losses():
    m = trial_metrics({"val_losses": {"all": 5.0, "code": 4.0, "docs": 6.0}})
    assert m == {"val_loss": 5.0, "val_loss/code": 4.0, "val_loss/docs": 6.0}
    assert parse_target("val_loss").value(m) == 5.0
    assert parse_target("val_loss/docs").value(m) == 6.0
    assert parse_target("0.25*val_loss/code+0.75*val_loss/docs").value(m) == pytest.approx(5.5)
    assert parse_target("val_loss/pkgdocs").value(m) is None
    for bad, msg in [("loss", "not val_loss"), ("x*val_loss", "not a number"),
                     ("-1*val_loss", "must be > 0"), ("val_loss/web", "no source 'web'")]:
        with pytest.raises(UserError, match=msg):
            parse_target(bad, ["code", "docs"])
