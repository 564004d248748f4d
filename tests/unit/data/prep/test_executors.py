"""How the Ray executor cuts a stage's work items into tasks (`guided_blocks`), and
what the driver learns of the workers' time (`Received`)."""

from __future__ import annotations

import json

import pyarrow as pa

from trainlab.data.prep.executors import BUSY_COLUMN, Received, even_blocks, guided_blocks


def test_guided_blocks_keep_every_item_once_heaviest_first_and_shrink():
    weights = [5, 1, 9, 3, 3, 7, 2, 8, 1, 4] * 12
    items = [{"index": i, "weight": w} for i, w in enumerate(weights)]
    blocks = guided_blocks(items, workers=2)
    flat = [i for b in blocks for i in b]
    assert sorted(i["index"] for i in flat) == list(range(len(items)))
    assert [i["weight"] for i in flat] == sorted(weights, reverse=True)
    sizes = [sum(i["weight"] for i in b) for b in blocks]
    # Each block is about half the weight left per worker: few blocks, shrinking to
    # single small items at the end, so no worker finishes a big block alone.
    assert 6 <= len(blocks) <= 30
    assert sizes[0] >= sum(weights) / 4 and sizes[-1] <= 2
    assert all(a >= b for a, b in zip(sizes, sizes[1:], strict=False))


def test_guided_blocks_without_weights_count_items():
    blocks = guided_blocks([{"index": i} for i in range(8)], workers=4)
    assert [len(b) for b in blocks] == [1] * 8
    assert guided_blocks([], workers=2) == []


def test_even_blocks_are_runs_of_about_equal_weight_in_order():
    items = [{"index": i, "weight": w} for i, w in enumerate([4, 1, 1, 2, 3, 1, 1, 3])]
    blocks = even_blocks(items, workers=2)
    assert [i["index"] for b in blocks for i in b] == list(range(8))  # order kept
    assert [sum(i["weight"] for i in b) for b in blocks] == [8, 8]
    assert len(even_blocks(items[:1], workers=4)) == 1


def test_received_strips_the_busy_spans_and_measures_idle_time():
    received = Received()
    for worker, start, end in [("a", 0.0, 6.0), ("b", 0.5, 9.0), ("a", 6.0, 9.5)]:
        table = pa.table({"index": [0, 1], BUSY_COLUMN: [json.dumps([worker, start, end]), None]})
        assert received.count("unit_stage", table).column_names == ["index"]
    use = received.utilisation("unit_stage", 0.0, 10.0, workers=2)
    assert use["busy_s"] == 6.0 + 8.5 + 3.5
    assert use["busy_share"] == 18.0 / 20.0
    assert use["first_s"] == 0.0
    assert use["tail_idle_s"] == (10.0 - 9.5) + (10.0 - 9.0)
    assert received.document_bytes == 0
