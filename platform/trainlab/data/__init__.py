"""trainlab.data: the training stream (read-time mixing and packing).

Contract 3 in docs/contracts.md. On the driver:

    spec = prepare_run_data(cfg)          # checks dataset, mix, repetition cap

In each training worker (rank r of w data-parallel ranks):

    loader = WorkerLoader(spec, r, w)     # Ray Data when Ray runs, else in process
    loader.load_state_dict(ckpt["data"])  # on resume: checks the fingerprint
    for step, micro_batches in loader.iter_from(loader.step):
        ...                               # grad_accum_steps micro batches per step
    loader.validation_batches("code", n)  # held-out documents of a source
    loader.delivered_shares(step)         # token share per source so far

A batch is a dict of numpy arrays [rows, seq_len]: input_ids, labels,
position_ids (int64) and document_ids (int32). The sequences of global step s
are a pure function of (dataset fingerprint, mix, seed, seq_len, global batch
size, s). Data preparation (`trainlab prep`) lives in trainlab.data.prep.
"""

from trainlab.data.loader import WorkerLoader, check_resume
from trainlab.data.manifest import Manifest, load_manifest
from trainlab.data.pack import BATCH_KEYS, IGNORE_INDEX, Batch
from trainlab.data.spec import DataSpec, prepare_run_data
from trainlab.data.stream import TrainStream

__all__ = [
    "BATCH_KEYS",
    "IGNORE_INDEX",
    "Batch",
    "DataSpec",
    "Manifest",
    "TrainStream",
    "WorkerLoader",
    "check_resume",
    "load_manifest",
    "prepare_run_data",
]
