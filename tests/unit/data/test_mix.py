"""The token-share schedule: prefix exactness, resumable memo, epoch orders,
normalization and the repetition cap (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from trainlab.data.mix import (
    WEIGHT_SCALE,
    BlendSchedule,
    check_repetition_cap,
    epoch_order,
    normalize_mix,
    quantize_weights,
)
from trainlab.errors import UserError


def _prefix_counts(weights: list[float], rows: int) -> np.ndarray:
    """counts[r, i] = rows from source i among the first r+1 rows."""
    sources, _ = BlendSchedule(weights).assign(0, rows)
    return np.cumsum(np.eye(len(weights), dtype=np.int64)[sources], axis=0)


@pytest.mark.parametrize(
    "weights",
    [
        [0.5, 0.3, 0.2],
        [0.97, 0.02, 0.01],
        [1 / 3, 1 / 3, 1 / 3],
        [0.6, 0.4],
    ],
)
def test_every_prefix_matches_the_weights_within_one_row(weights: list[float]) -> None:
    rows = 5000
    counts = _prefix_counts(weights, rows)
    target = np.outer(np.arange(1, rows + 1), weights)
    assert np.abs(counts - target).max() < 1.0


def test_prefix_error_stays_bounded_for_many_random_mixes() -> None:
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(30):
        w = rng.dirichlet(np.full(int(rng.integers(2, 7)), 0.7))
        counts = _prefix_counts(list(w), 2000)
        worst = max(worst, float(np.abs(counts - np.outer(np.arange(1, 2001), w)).max()))
    # Megatron's greedy blending: within about one scheduled unit of the target.
    assert worst < 1.5


def test_schedule_from_any_row_equals_the_uninterrupted_one() -> None:
    weights = [0.55, 0.25, 0.2]
    full_sources, full_units = BlendSchedule(weights, memo_every=64).assign(0, 3000)
    for start, stop in [(0, 1), (63, 65), (64, 128), (1000, 1777), (2999, 3000)]:
        fresh = BlendSchedule(weights, memo_every=64)  # a restarted process
        sources, units = fresh.assign(start, stop)
        assert np.array_equal(sources, full_sources[start:stop])
        assert np.array_equal(units, full_units[start:stop])


def test_units_of_each_source_are_consecutive_none_twice_none_skipped() -> None:
    sources, units = BlendSchedule([0.5, 0.3, 0.2]).assign(0, 2000)
    for i in range(3):
        assert np.array_equal(units[sources == i], np.arange(int((sources == i).sum())))


def test_quantized_weights_are_exact_integers_summing_to_the_scale() -> None:
    q = quantize_weights([0.5, 0.3, 0.2])
    assert sum(q) == WEIGHT_SCALE
    assert all(abs(a / WEIGHT_SCALE - w) < 1e-9 for a, w in zip(q, [0.5, 0.3, 0.2], strict=True))
    assert min(quantize_weights([1.0, 1e-15])) >= 1  # a tiny weight still exists


def test_epoch_order_is_a_fixed_permutation_that_changes_per_epoch_seed_and_source() -> None:
    a = epoch_order(1234, "code", 0, 500)
    assert sorted(a.tolist()) == list(range(500))
    assert np.array_equal(a, epoch_order(1234, "code", 0, 500))
    for other in (
        epoch_order(1234, "code", 1, 500),
        epoch_order(1, "code", 0, 500),
        epoch_order(1234, "docs", 0, 500),
    ):
        assert not np.array_equal(a, other)
    # Pinned values: a numpy upgrade or a refactor must not silently change every run's data.
    assert epoch_order(1234, "code", 0, 8).tolist() == [1, 6, 5, 0, 2, 4, 7, 3]


def test_empty_mix_means_every_source_by_its_tokens() -> None:
    w = normalize_mix({}, {"code": 300, "docs": 100})
    assert w == {"code": 0.75, "docs": 0.25}


def test_mix_is_normalized_in_manifest_order() -> None:
    w = normalize_mix({"docs": 2, "code": 6}, {"code": 300, "docs": 100, "other": 5})
    assert list(w) == ["code", "docs"] and w == {"code": 0.75, "docs": 0.25}


def test_unknown_source_is_a_user_error_naming_it() -> None:
    with pytest.raises(UserError, match=r"data\.mix\.cod: no source 'cod'.*sources: code, docs"):
        normalize_mix({"cod": 1.0}, {"code": 300, "docs": 100})


def test_source_without_training_tokens_is_a_user_error() -> None:
    with pytest.raises(UserError, match="data.mix.docs: source 'docs' has no training tokens"):
        normalize_mix({"code": 1, "docs": 1}, {"code": 300, "docs": 0})


def test_repetition_cap_names_the_source_and_the_epochs_it_needs() -> None:
    # 100 steps x 10 rows x 16 tokens = 16,000 tokens; docs gets 30% = 4,800 of its 1,000.
    args = dict(
        names=["code", "docs"],
        weights=[0.7, 0.3],
        train_tokens=[100_000, 1000],
        seq_len=16,
        total_rows=1000,
        total_steps=100,
    )
    with pytest.raises(UserError) as e:
        check_repetition_cap(max_epochs=4.0, **args)
    (line,) = e.value.lines
    assert "'docs' needs 4.80 epochs" in line and "max_epochs_per_source=4" in line
    assert "train.total_steps=100" in line and "'code'" not in line
    needed = check_repetition_cap(max_epochs=4.8, **args)  # exactly at the cap is allowed
    assert needed == {"code": pytest.approx(0.112), "docs": pytest.approx(4.8)}


def test_periodic_fast_forward_equals_replaying_every_row() -> None:
    """Counts far into a run come from the period (Q rows) instead of a replay from
    row 0; they must be exactly what the replay gives."""
    weights = [0.45, 0.35, 0.2]
    fast = BlendSchedule(weights, memo_every=97, scale=1000)
    assert fast.periodic
    replay = BlendSchedule(weights, memo_every=97, scale=1000)
    for row in (999, 1000, 1001, 2500, 7777):
        assert fast.counts_at(row).tolist() == replay._run([0, 0, 0], 0, row)
    sources, units = fast.assign(5990, 6020)  # across a period boundary
    ref = np.empty(6020, dtype=np.int64)
    replay._run([0, 0, 0], 0, 6020, ref)
    assert np.array_equal(sources, ref[5990:])
    for i in range(3):
        assert np.array_equal(
            units[sources == i], int((ref[:5990] == i).sum()) + np.arange(int((sources == i).sum()))
        )
