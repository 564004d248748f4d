"""Helpers for training tests: a small stream in the training-stream contract
format (docs/contracts.md, section 3) over real text, and tiny configs.

The stream packs byte-level tokens of real Python source files (this
repository's own and the standard library's) into rows with position_ids,
document_ids and labels exactly as the contract defines them, and is a pure
function of the step. It lets the loop be tested without Ray and without the
prepared-dataset machinery.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainlab.config import ExperimentConfig, config_hash
from trainlab.plan import plan, resolve_layout
from trainlab.train.job import TrainJob

EOS = 0
VOCAB = 257  # bytes shifted by one, EOS = 0


def real_documents(source: str, n: int = 40) -> list[np.ndarray]:
    """Byte-level token ids of real text: standard-library modules ("code") or
    their docstrings ("docs")."""
    import asyncio
    import collections
    import email
    import json as json_mod
    import logging
    import pathlib

    docs = []
    for mod in (collections, json_mod, logging, pathlib, asyncio, email):
        text = inspect.getsource(mod) if source == "code" else (mod.__doc__ or "")
        for i in range(0, len(text), 700):
            chunk = text[i : i + 700].encode()
            if chunk:
                docs.append(np.frombuffer(chunk, dtype=np.uint8).astype(np.int64) + 1)
            if len(docs) == n:
                return docs
    return docs


class ContractStream:
    """WorkerLoader-compatible stream (iter_from, validation_batches,
    delivered_shares, state_dict, load_state_dict)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        rank: int = 0,
        world_size: int = 1,
        sources: tuple[str, ...] = ("code", "docs"),
    ):
        self.cfg, self.rank, self.world = cfg, rank, world_size
        self.sources = sources
        docs = {s: real_documents(s) for s in sources}
        self.train_docs = {s: d[:-4] for s, d in docs.items()}
        self.val_docs = {s: d[-4:] for s, d in docs.items()}
        self.fingerprint = hashlib.sha256(
            b"".join(x.tobytes() for s in sources for x in docs[s])
        ).hexdigest()[:16]
        self.step = 0

    def _row(self, docs: list[np.ndarray], index: int) -> dict[str, np.ndarray]:
        t = self.cfg.data.seq_len
        ids = np.full(t, EOS, dtype=np.int64)
        pos = np.zeros(t, dtype=np.int64)
        doc_ids = np.full(t, -1, dtype=np.int32)
        at, d = 0, index
        k = 0
        while at < t:
            doc = np.append(docs[d % len(docs)], EOS)
            offset = (index * 37) % len(doc) if k == 0 else 0  # a continuation keeps its positions
            piece = doc[offset : offset + (t - at)]
            ids[at : at + len(piece)] = piece
            pos[at : at + len(piece)] = np.arange(offset, offset + len(piece))
            doc_ids[at : at + len(piece)] = k
            at += len(piece)
            d += 1
            k += 1
        labels = np.full(t, -100, dtype=np.int64)
        same = doc_ids[1:] == doc_ids[:-1]
        labels[:-1] = np.where(same, ids[1:], -100)
        return {"input_ids": ids, "labels": labels, "position_ids": pos, "document_ids": doc_ids}

    def global_rows(self, step: int) -> list[dict[str, np.ndarray]]:
        g = self.cfg.global_batch_size
        rows = []
        for r in range(g):
            index = step * g + r
            source = self.sources[index % len(self.sources)]
            rows.append(self._row(self.train_docs[source], index // len(self.sources)))
        return rows

    def batches_for(self, step: int) -> list[dict[str, np.ndarray]]:
        rows = self.global_rows(step)
        per_rank = len(rows) // self.world
        mine = rows[self.rank * per_rank : (self.rank + 1) * per_rank]
        mb = self.cfg.data.micro_batch_size
        return [
            {k: np.stack([r[k] for r in mine[i : i + mb]]) for k in mine[0]}
            for i in range(0, len(mine), mb)
        ]

    def iter_from(self, step: int):
        while True:
            self.step = step
            yield step, self.batches_for(step)
            step += 1

    def validation_batches(self, source: str, n: int) -> list[dict[str, np.ndarray]]:
        rows = [self._row(self.val_docs[source], i) for i in range(n)]
        return [{k: np.stack([r[k] for r in rows]) for k in rows[0]}]

    def delivered_shares(self, step: int) -> dict[str, float]:
        return {s: 1.0 / len(self.sources) for s in self.sources}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["fingerprint"] != self.fingerprint:
            raise ValueError("fingerprint mismatch")
        self.step = state["step"]


TINY = {
    "name": "unit",
    "model": {
        "arch": "llama",
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_hidden_size": 64,
        "vocab_size": VOCAB,
        "max_seq_len": 64,
    },
    "data": {"seq_len": 32, "micro_batch_size": 4, "mix": {"code": 0.5, "docs": 0.5}},
    "train": {
        "lr": 3e-3,
        "warmup_steps": 2,
        "total_steps": 12,
        "log_interval": 2,
        "eval_interval": 4,
        "eval_batches": 2,
        "deterministic": True,
        "checkpoint": {"every_steps": 4, "keep_last": 2, "keep_best": 1},
    },
    "parallel": {"strategy": "ddp"},
    "resource": {"num_workers": 1},
}


def tiny_config(**sections: dict[str, Any]) -> ExperimentConfig:
    raw = json.loads(json.dumps(TINY))
    for name, values in sections.items():
        if isinstance(values, dict):
            for k, v in values.items():
                if isinstance(v, dict) and isinstance(raw[name].get(k), dict):
                    raw[name][k].update(v)
                else:
                    raw[name][k] = v
        else:
            raw[name] = values
    return ExperimentConfig.model_validate(raw)


def make_job(
    cfg: ExperimentConfig,
    run_dir: Path,
    fingerprint: str,
    sources: tuple[str, ...] = ("code", "docs"),
) -> TrainJob:
    cfg = resolve_layout(cfg)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    return TrainJob(
        cfg=cfg.model_dump(mode="json"),
        plan=plan(cfg).to_json(),
        run_dir=str(run_dir),
        config_hash=config_hash(cfg),
        dataset_fingerprint=fingerprint,
        manifest_path=str(run_dir / "manifest.json"),
        data_spec=None,
        sources=list(sources),
        session="test",
        started_at=time.time(),
    )


def stream_factory(spec: dict[str, Any], rank: int, world_size: int) -> ContractStream:
    """`TrainJob.loader_factory` for tests: `spec` is the config as a dict."""
    return ContractStream(ExperimentConfig.model_validate(spec), rank, world_size)


def contract_data(cfg: ExperimentConfig) -> Any:
    """`launcher.DataInfo` for the contract stream of `cfg`."""
    from trainlab.train.launcher import DataInfo

    stream = ContractStream(cfg)
    return DataInfo(
        spec=cfg.model_dump(mode="json"),
        fingerprint=stream.fingerprint,
        manifest_path="/dev/null",
        sources=list(stream.sources),
    )
