"""Packing: positions, document ids, labels, padding and splitting (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from devtools.datasets import small_dataset
from trainlab.data.corpus import SourceTokens, read_source
from trainlab.data.manifest import load_manifest
from trainlab.data.pack import IGNORE_INDEX, SourceStream, pack_units

EOS = 0


def _source(lengths: list[int], name: str = "s") -> SourceTokens:
    """Documents whose tokens say where they come from: doc d, position p -> 100*(d+1)+p,
    with EOS as each document's last token."""
    docs = [[100 * (d + 1) + p for p in range(n - 1)] + [EOS] for d, n in enumerate(lengths)]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return SourceTokens(
        name=name,
        tokens=np.array(sum(docs, []), dtype=np.uint16),
        offsets=offsets,
        train_docs=np.arange(len(lengths), dtype=np.int64),
        val_docs=np.zeros(0, np.int64),
    )


def _in_order(src: SourceTokens, seq_len: int, units: int) -> dict[str, np.ndarray]:
    stream = SourceStream(src, src.train_docs, seed=0, shuffle=False)
    return pack_units([stream], np.zeros(units, np.int64), np.arange(units), seq_len, EOS).batch


def test_positions_reset_at_each_document_and_ids_count_documents_in_the_row() -> None:
    b = _in_order(_source([4, 3, 5]), seq_len=12, units=1)
    assert b["input_ids"][0].tolist() == [100, 101, 102, 0, 200, 201, 0, 300, 301, 302, 303, 0]
    assert b["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]
    assert b["document_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]


def test_labels_are_the_next_token_of_the_same_document_else_ignored() -> None:
    b = _in_order(_source([4, 3, 5]), seq_len=12, units=1)
    m = IGNORE_INDEX
    assert b["labels"][0].tolist() == [101, 102, 0, m, 201, 0, m, 301, 302, 303, 0, m]


def test_a_long_document_is_split_and_continues_with_its_positions() -> None:
    b = _in_order(_source([3, 10, 3]), seq_len=6, units=3)
    # Row 0: doc 0 whole, then doc 1's first 3 tokens; row 1 continues doc 1 at position 3.
    assert b["position_ids"].tolist() == [
        [0, 1, 2, 0, 1, 2],
        [3, 4, 5, 6, 7, 8],
        [9, 0, 1, 2, 0, 1],
    ]
    assert b["document_ids"].tolist() == [[0, 0, 0, 1, 1, 1], [0] * 6, [0, 1, 1, 1, 2, 2]]
    # The piece cut at a row end takes no loss on its last token (its target is elsewhere).
    assert b["labels"][0, 5] == IGNORE_INDEX and b["labels"][1, 5] == IGNORE_INDEX
    # Nothing dropped: the rows are exactly the documents, concatenated.
    src = _source([3, 10, 3])
    stream_tokens = np.concatenate([src.tokens, src.tokens])[:18]
    assert np.array_equal(b["input_ids"].ravel(), stream_tokens)


def test_rows_wrap_into_the_next_epoch() -> None:
    src = _source([3, 2])  # 5 tokens per epoch
    b = _in_order(src, seq_len=4, units=3)
    assert b["input_ids"].ravel().tolist() == (src.tokens.tolist() * 3)[:12]
    assert b["position_ids"][1].tolist() == [1, 0, 1, 2]  # epoch 1 starts doc 0 again


def test_padding_fills_the_end_of_a_finite_stream() -> None:
    src = _source([3, 2])
    stream = SourceStream(src, src.train_docs, seed=0, shuffle=False, finite=True)
    packed = pack_units([stream], np.zeros(3, np.int64), np.arange(3), 4, EOS)
    b = packed.batch
    assert b["input_ids"].tolist() == [[100, 101, 0, 200], [0, EOS, EOS, EOS], [EOS] * 4]
    assert b["document_ids"].tolist() == [[0, 0, 0, 1], [0, -1, -1, -1], [-1] * 4]
    assert b["labels"][1:].tolist() == [[IGNORE_INDEX] * 4] * 2
    assert b["position_ids"][1].tolist() == [1, 0, 0, 0]
    assert packed.row_doc_starts.tolist() == [2, 0, 0]
    assert packed.row_split.tolist() == [True, False, False]


def test_rows_need_not_be_consecutive_units_or_one_source() -> None:
    a, b = _source([5, 3], "a"), _source([2, 2, 2], "b")
    streams = [SourceStream(s, s.train_docs, seed=0, shuffle=False) for s in (a, b)]
    packed = pack_units(streams, np.array([1, 0, 1, 0]), np.array([2, 0, 0, 1]), 4, EOS)
    b_stream = b.tokens.tolist() * 3
    a_stream = a.tokens.tolist() * 2
    assert packed.batch["input_ids"].tolist() == [
        b_stream[8:12],
        a_stream[0:4],
        b_stream[0:4],
        a_stream[4:8],
    ]
    assert packed.row_source.tolist() == [1, 0, 1, 0]


@pytest.fixture(scope="module")
def real_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, np.ndarray], int]:
    root = small_dataset(tmp_path_factory.getbasetemp() / "small-ds")
    manifest = load_manifest(root)
    src = read_source(manifest, "code", val_fraction=0.1)
    stream = SourceStream(src, src.train_docs, seed=7, shuffle=True)
    units = 60_000 // 128
    return pack_units(
        [stream], np.zeros(units, np.int64), np.arange(units), 128, manifest.eos_id
    ).batch, manifest.eos_id


def test_real_rows_keep_the_batch_contract(real_rows: tuple[dict[str, np.ndarray], int]) -> None:
    b, eos = real_rows
    assert {k: (v.dtype.name, v.shape[1]) for k, v in b.items()} == {
        "input_ids": ("int64", 128),
        "labels": ("int64", 128),
        "position_ids": ("int64", 128),
        "document_ids": ("int32", 128),
    }
    same_doc = b["document_ids"][:, 1:] == b["document_ids"][:, :-1]
    # Within a document: positions step by one and labels are the next input token.
    assert (np.diff(b["position_ids"], axis=1)[same_doc] == 1).all()
    assert np.array_equal(b["labels"][:, :-1][same_doc], b["input_ids"][:, 1:][same_doc])
    # Where the document changes, the new one starts at position 0 (or continues a split).
    assert (b["labels"][:, :-1][~same_doc] == IGNORE_INDEX).all()
    assert (b["labels"][:, -1] == IGNORE_INDEX).all()
    new_doc = np.concatenate([np.ones((len(b["input_ids"]), 1), bool), ~same_doc], axis=1)
    starts_mid_row = new_doc.copy()
    starts_mid_row[:, 0] = False
    assert (b["position_ids"][starts_mid_row] == 0).all()
    # Every document in a row but the last ends with EOS; training rows have no padding.
    ends = np.concatenate([~same_doc, np.zeros((len(b["input_ids"]), 1), bool)], axis=1)
    assert (b["input_ids"][ends] == eos).all()
    assert (b["document_ids"] >= 0).all()
