"""Which config keys `compare` lists as differing: a key an older run's record does
not have (the schema gained it later) differs from a value, not from null (the
demo's `tiny` against a newer `tiny-2` listed `model.moe` and `parallel.ep` with
two blank cells)."""

from __future__ import annotations

from trainlab.track.query import differing_keys


def test_a_key_missing_from_an_older_record_differs_only_from_a_value():
    older = {"params": {"train.lr": 0.003}}
    newer = {"params": {"train.lr": 0.003, "model.moe": None, "parallel.ep": 1}}
    assert differing_keys([newer, older]) == ["parallel.ep"]
    other = {"params": {"train.lr": 0.003, "parallel.ep": 2}}
    assert differing_keys([newer, other]) == ["parallel.ep"]
    assert differing_keys([newer, {"params": {"train.lr": 0.01}}]) == ["parallel.ep", "train.lr"]
