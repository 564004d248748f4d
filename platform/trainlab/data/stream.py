"""The training stream as a pure function of the step.

Global step s is rows [s*G, (s+1)*G) of the blended stream (G = global batch
size); row r is unit `units[r]` of source `sources[r]` from the BlendSchedule.
Rank `rank` of `world` gets the contiguous slice [rank*G/world, (rank+1)*G/world)
of each step, so the global sequence order does not depend on the number of
data-parallel workers. Nothing here keeps a position: resuming is asking for a
later step.
"""

from __future__ import annotations

import numpy as np

from trainlab.data.corpus import SourceTokens, load_corpus
from trainlab.data.mix import BlendSchedule
from trainlab.data.pack import Batch, PackedRows, SourceStream, pack_units, slice_batch
from trainlab.data.spec import DataSpec, rows_per_rank
from trainlab.errors import UserError


def split_micro_batches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    rows = len(batch["input_ids"])
    return [slice_batch(batch, i, i + micro_batch_size) for i in range(0, rows, micro_batch_size)]


class TrainStream:
    """Training rows, validation rows and delivery statistics of one DataSpec."""

    def __init__(self, spec: DataSpec, corpus: dict[str, SourceTokens] | None = None):
        self.spec = spec
        if corpus is None:
            corpus = load_corpus(
                spec.path, spec.fingerprint, spec.all_sources or spec.sources, spec.val_fraction
            )
        self.corpus = corpus
        self.schedule = BlendSchedule(spec.weights)
        self.streams = [
            SourceStream(corpus[n], corpus[n].train_docs, spec.seed, shuffle=True)
            for n in spec.sources
        ]
        self._val_streams: dict[str, SourceStream] = {}

    # ------------------------------------------------------------------ training rows

    def rows(self, start: int, stop: int) -> PackedRows:
        sources, units = self.schedule.assign(start, stop)
        return pack_units(self.streams, sources, units, self.spec.seq_len, self.spec.eos_id)

    def rank_rows(
        self, step: int, rank: int = 0, world_size: int = 1, steps: int = 1
    ) -> PackedRows:
        """This rank's rows of global steps [step, step + steps), step after step.
        Packing several steps in one call amortizes numpy's per-call cost."""
        per_rank = rows_per_rank(self.spec, world_size)
        g = self.spec.global_batch_size
        sources, units = self.schedule.assign(step * g, (step + steps) * g)
        mine = (np.arange(steps)[:, None] * g + rank * per_rank + np.arange(per_rank)).ravel()
        return pack_units(
            self.streams, sources[mine], units[mine], self.spec.seq_len, self.spec.eos_id
        )

    def global_batch(self, step: int) -> Batch:
        return self.rank_rows(step).batch

    # ------------------------------------------------------------------ validation rows

    def validation_stream(self, source: str) -> SourceStream:
        if source not in self.corpus:
            raise UserError(
                f"validation source {source!r}: not in the prepared dataset "
                f"(sources: {', '.join(self.corpus)})"
            )
        if source not in self._val_streams:
            src = self.corpus[source]
            self._val_streams[source] = SourceStream(
                src, src.val_docs, self.spec.seed, shuffle=False, finite=True
            )
        return self._val_streams[source]

    def validation_rows(self, source: str, start: int, stop: int) -> PackedRows:
        """Rows [start, stop) of the source's held-out documents, packed in a fixed
        order. Past the end of the validation set rows are padding (labels -100)."""
        packed = pack_units(
            [self.validation_stream(source)],
            np.zeros(stop - start, np.int64),
            np.arange(start, stop),
            self.spec.seq_len,
            self.spec.eos_id,
        )
        packed.row_source[:] = -1  # not a training source index
        return packed

    # ------------------------------------------------------------------ accounting

    def delivered_rows(self, step: int) -> np.ndarray:
        """Rows per source in global steps [0, step)."""
        return self.schedule.counts_at(step * self.spec.global_batch_size)

    def delivered_shares(self, step: int) -> dict[str, float]:
        """Token share per source over global steps [0, step) (the weights at step 0)."""
        rows = self.delivered_rows(step)
        total = int(rows.sum())
        if total == 0:
            return dict(zip(self.spec.sources, self.spec.weights, strict=True))
        return {n: int(r) / total for n, r in zip(self.spec.sources, rows, strict=True)}
