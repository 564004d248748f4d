"""The training stream end to end without Ray: exact coverage across epochs,
held-out validation, exact resumption, worker-count independence, fingerprint
checks and the driver-side checks of prepare_run_data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devtools.datasets import small_dataset
from trainlab.config import ExperimentConfig
from trainlab.data import DataSpec, TrainStream, WorkerLoader, prepare_run_data
from trainlab.data.mix import epoch_order
from trainlab.errors import UserError


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_dataset(tmp_path_factory.getbasetemp() / "small-ds")


def make_cfg(path: Path, total_steps: int = 40, workers: int = 2, **data: Any) -> ExperimentConfig:
    d = {
        "path": str(path),
        "seq_len": 32,
        "micro_batch_size": 2,
        "grad_accum_steps": 2,
        "mix": {"code": 0.6, "docs": 0.3, "tiny": 0.1},
        "val_fraction": 0.1,
        **data,
    }
    return ExperimentConfig.model_validate(
        {
            "name": "t",
            "model": {"vocab_size": 1024},
            "data": d,
            "train": {"total_steps": total_steps, "warmup_steps": 1},
            "resource": {"num_workers": workers},
        }
    )


@pytest.fixture(scope="module")
def spec(dataset: Path) -> DataSpec:
    return prepare_run_data(make_cfg(dataset))


def _collect(loader: WorkerLoader, start: int, stop: int) -> list[tuple[int, list[dict]]]:
    return list(loader.iter_from(start, stop))


def _same(a: list[tuple[int, list[dict]]], b: list[tuple[int, list[dict]]]) -> bool:
    if [s for s, _ in a] != [s for s, _ in b]:
        return False
    return all(
        len(x) == len(y)
        and all(
            xm.keys() == ym.keys()
            and all(np.array_equal(xm[k], ym[k]) and xm[k].dtype == ym[k].dtype for k in xm)
            for xm, ym in zip(x, y, strict=True)
        )
        for (_, x), (_, y) in zip(a, b, strict=True)
    )


# --------------------------------------------------------------------------- the stream


def test_each_step_has_grad_accum_micro_batches_of_the_contract_shape(spec: DataSpec) -> None:
    ((step, micro),) = _collect(WorkerLoader(spec, 1, 2), 5, 6)
    assert step == 5 and len(micro) == spec.grad_accum_steps
    for m in micro:
        assert {k: v.shape for k, v in m.items()} == {
            k: (spec.micro_batch_size, spec.seq_len)
            for k in ("input_ids", "labels", "position_ids", "document_ids")
        }


def test_each_source_is_delivered_in_epoch_order_every_token_once_per_epoch(spec: DataSpec) -> None:
    """Concatenating a source's rows, in stream order, gives its documents in each
    epoch's order, epoch after epoch: nothing repeated early, nothing skipped."""
    stream = TrainStream(spec)
    packed = stream.rows(0, 100 * spec.global_batch_size)
    tiny = spec.sources.index("tiny")
    epochs = 0
    for i, name in enumerate(spec.sources):
        src = stream.corpus[name]
        delivered = packed.batch["input_ids"][packed.row_source == i].ravel()
        expected, e = [], 0
        while sum(map(len, expected)) < len(delivered):
            for d in src.train_docs[epoch_order(spec.seed, name, e, len(src.train_docs))]:
                expected.append(src.tokens[src.offsets[d] : src.offsets[d + 1]])
            e += 1
        assert np.array_equal(delivered, np.concatenate(expected)[: len(delivered)]), name
        if i == tiny:
            epochs = e
    assert epochs >= 3  # the small source really was repeated, in fresh orders


def test_training_never_sees_validation_documents(spec: DataSpec) -> None:
    stream = TrainStream(spec)
    for i, name in enumerate(spec.sources):
        src = stream.corpus[name]
        assert len(src.val_docs) >= 1
        assert not set(src.val_docs.tolist()) & set(src.train_docs.tolist())
        pieces = stream.streams[i].pieces(0, 400 * spec.seq_len, spec.seq_len)
        seen = set(pieces.doc.tolist())
        assert seen <= set(src.train_docs.tolist()) and not seen & set(src.val_docs.tolist())


def test_delivered_shares_match_the_weights_within_one_point(spec: DataSpec) -> None:
    loader = WorkerLoader(spec, 0, 1)
    _collect(loader, 0, 40)
    rows = loader.delivery.rows
    total = sum(rows.values())
    for name, w in zip(spec.sources, spec.weights, strict=True):
        assert abs(rows[name] / total - w) < 0.01
        assert abs(loader.delivered_shares(40)[name] - w) < 0.01


# --------------------------------------------------------------------------- resume, topology


def test_resume_at_step_k_continues_the_uninterrupted_stream_exactly(spec: DataSpec) -> None:
    uninterrupted = _collect(WorkerLoader(spec, 1, 2), 0, 30)
    first = WorkerLoader(spec, 1, 2)
    part = []
    for step, micro in first.iter_from(0, 30):
        part.append((step, micro))
        if step == 12:
            break  # "killed" after training on step 12
    state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    assert state["step"] == 13 and state["fingerprint"] == spec.fingerprint
    resumed = WorkerLoader(spec, 1, 2)
    resumed.load_state_dict(state)
    rest = list(resumed.iter_from(end=30))  # continues at the restored step
    assert _same(part + rest, uninterrupted)


def test_changing_the_worker_count_keeps_the_global_sequence_order(dataset: Path) -> None:
    by_world = {}
    for world in (1, 2, 4):
        # Same global batch (8 rows): micro batch x accumulation x workers.
        cfg = make_cfg(dataset, workers=world, micro_batch_size=2, grad_accum_steps=4 // world)
        spec = prepare_run_data(cfg)
        assert spec.global_batch_size == 8
        steps = []
        for s in range(10):
            rows = [
                np.concatenate([m["input_ids"] for m in micro])
                for r in range(world)
                for _, micro in WorkerLoader(spec, r, world).iter_from(s, s + 1)
            ]
            steps.append(np.concatenate(rows))
        by_world[world] = np.stack(steps)
    assert np.array_equal(by_world[1], by_world[2]) and np.array_equal(by_world[1], by_world[4])


def test_a_global_batch_that_does_not_split_evenly_is_refused(spec: DataSpec) -> None:
    with pytest.raises(UserError, match="cannot be split into 3 equal slices"):
        WorkerLoader(spec, 0, 3)


# --------------------------------------------------------------------------- fingerprint


def test_resuming_on_a_different_dataset_is_an_error_unless_allowed(
    dataset: Path, spec: DataSpec
) -> None:
    state = {"step": 7, "fingerprint": "0" * 64}
    with pytest.raises(UserError, match="fingerprint .* differs from the checkpoint's 0000") as e:
        WorkerLoader(spec).load_state_dict(state)
    assert "data.allow_fingerprint_change=true" in str(e.value)
    allowed = prepare_run_data(make_cfg(dataset, allow_fingerprint_change=True))
    loader = WorkerLoader(allowed)
    loader.load_state_dict(state)
    assert loader.step == 7


# --------------------------------------------------------------------------- validation


def test_validation_rows_do_not_depend_on_the_worker_count(dataset: Path) -> None:
    one = WorkerLoader(prepare_run_data(make_cfg(dataset, workers=1, grad_accum_steps=4)), 0, 1)
    spec2 = prepare_run_data(make_cfg(dataset, workers=2))
    two = [WorkerLoader(spec2, r, 2) for r in range(2)]
    whole = np.concatenate([m["input_ids"] for m in one.validation_batches("docs", 2)])
    # Rank slices of each validation global batch, put back in order.
    per_rank = [[m["input_ids"] for m in loader.validation_batches("docs", 2)] for loader in two]
    rebuilt = np.concatenate(
        [np.concatenate(per_rank[r][2 * k : 2 * k + 2]) for k in range(2) for r in range(2)]
    )
    assert np.array_equal(whole, rebuilt)


def test_validation_pads_past_the_end_of_a_small_held_out_set(spec: DataSpec) -> None:
    loader = WorkerLoader(spec, 0, 2)
    held_out = spec.val_tokens[spec.sources.index("tiny")]
    batches = loader.validation_batches("tiny", 3)
    real = sum(int((m["document_ids"] >= 0).sum()) for m in batches)
    assert 0 < real <= held_out
    assert all(((m["labels"] == -100) | (m["document_ids"] >= 0)).all() for m in batches)
    assert (batches[-1]["document_ids"] == -1).all()


# --------------------------------------------------------------------------- driver checks


def test_mix_that_exceeds_the_repetition_cap_fails_before_training(dataset: Path) -> None:
    cfg = make_cfg(dataset, total_steps=2000, max_epochs_per_source=5)
    with pytest.raises(UserError, match=r"'tiny' needs \d+\.\d\d epochs .*max_epochs_per_source=5"):
        prepare_run_data(cfg)


def test_unknown_mixed_source_is_a_user_error(dataset: Path) -> None:
    with pytest.raises(UserError, match="data.mix.prose: no source 'prose'"):
        prepare_run_data(make_cfg(dataset, mix={"code": 1.0, "prose": 1.0}))


def test_missing_dataset_says_to_run_prep(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no prepared dataset .* run `trainlab prep SOURCES --out .*nowhere` first"):
        prepare_run_data(make_cfg(tmp_path / "nowhere"))


def test_a_shard_changed_after_prep_is_detected(dataset: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ds"
    shutil.copytree(dataset, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    shard = copy / manifest["sources"]["docs"]["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    with pytest.raises(UserError, match="sha256 differs from the manifest"):
        prepare_run_data(make_cfg(copy))


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused(dataset: Path) -> None:
    cfg = make_cfg(dataset).model_copy(deep=True)
    cfg.model.vocab_size = 512
    with pytest.raises(UserError, match="model.vocab_size = 512: smaller than"):
        prepare_run_data(cfg)
