"""The per-worker training loop: `fit`, one step, `evaluate`.

One `Trainer` per training process: it builds the `TrainState`, restores the
newest valid checkpoint through the `Checkpointer`, then runs steps from the
data stream until `train.total_steps`, with evaluation, checkpoints, metrics and
callbacks at their intervals. It runs the same in a Ray Train worker's training
process and in a plain process (world size 1, no process group), which is how
the unit tests drive it.

Steps are counted as optimizer steps done: "step 20" is the state after 20
updates, checkpoint step-00000020 holds it, and resuming from it asks the data
stream for global step 20 (the 21st batch).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from trainlab.run import checkpoints as ckpts
from trainlab.run.records import (
    INTERRUPT_REASON,
    SUMMARY,
    Failure,
    RunRecords,
)
from trainlab.runstatus import RunStatus
from trainlab.train import checkpoint as ck
from trainlab.train.job import TrainJob
from trainlab.train.loop.callbacks import Callback, CallbackList, RunContext
from trainlab.train.loop.checkpointer import Checkpointer, layout_of
from trainlab.train.loop.components import (
    ROLLED_BACK,
    Chaos,
    Checkpointing,
    Component,
    Evaluator,
    MetricsLog,
    P0Guard,
    build_components,
)
from trainlab.train.loop.growth import GrowthHold
from trainlab.train.loop.metrics import (
    HOLD,
    NO_STOP,
    STOP,
    STOP_AND_SAVE,
    Meter,
    P0Rules,
    StepSignals,
    launch,
    memory_gap,
    peak_memory_bytes,
)
from trainlab.train.loop.node_chaos import NodeChaos
from trainlab.train.loop.state import (
    DataPosition,
    ModelState,
    Progress,
    TrainState,
)
from trainlab.train.loop.step import (
    IGNORE_INDEX,
    Batch,
    autocast_context,
    concat,
    fallback_batch,
    local_value,
    loss_context,
    loss_sum_and_count,
    to_tensors,
    train_step_tensors,
)
from trainlab.train.loop.stream import StreamLoader
from trainlab.train.parallel import reshard
from trainlab.train.parallel.compile import compile_seconds
from trainlab.train.parallel.compile import enabled as compile_on
from trainlab.train.parallel.distributed import DistEnv
from trainlab.train.summaries import failed_summary, planned_memory_bytes, run_summary

log = logging.getLogger("trainlab.train")


class Trainer:
    def __init__(
        self,
        job: TrainJob,
        loader: StreamLoader,
        env: DistEnv,
        callbacks: Callback | None = None,
        report: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.job, self.cfg, self.loader, self.env = job, job.cfg, loader, env
        self.callbacks = callbacks if env.is_main and callbacks is not None else CallbackList([])
        self.report = report  # ray.train.report in a Ray worker (a barrier: every rank calls it)
        self.records = RunRecords(job.run_dir)
        progress = Progress()
        self.state = TrainState(ModelState(self.cfg, env), progress, DataPosition(loader, progress))
        self.checkpointer = Checkpointer(job, env, self.state)
        self.meter = Meter(
            self.cfg, env.world_size, env.device, float(job.plan.get("flops_per_token") or 0.0)
        )
        self.start_step = 0
        self.restarts = 0
        self.last_loss: float | None = None
        self.last_checkpoint: ckpts.CheckpointInfo | None = None
        self.checkpoints: list[ckpts.CheckpointInfo] = []
        self.stop_reason = ""
        self.stopped_at: int | None = None  # the step a P0 action stopped the run at
        self.stop_signal = NO_STOP  # the newest stop request every rank agreed on
        self.stop = NO_STOP  # this step's stop decision (MetricsLog, request_stop)
        self.last_signals = StepSignals(0, float("nan"), float("nan"), 0, 0.0, 0.0)
        router = job.p0_router_rules if self.cfg.model.moe is not None else ()
        self.p0_rules = P0Rules(self.cfg.tracking.alerts, job.p0_rules, router)
        self.growth = GrowthHold(job.elastic)
        # The loop's components (trainlab.train.loop.components), in the order they act
        # at a step's end; more from train.components, before checkpointing.
        self.guard, self.chaos = P0Guard(), Chaos()
        self.evaluator, self.saver = Evaluator(), Checkpointing()
        self.components: list[Component] = [
            self.guard,
            self.chaos,
            NodeChaos(),
            MetricsLog(),
            self.evaluator,
            *build_components(self.cfg.train.components, self.cfg),
            self.saver,
        ]

    @property
    def step(self) -> int:
        return self.state.progress.step

    @property
    def model(self) -> torch.nn.Module:
        return self.state.model.model

    # ----------------------------------------------------------------- the loop

    def fit(self) -> dict[str, Any] | None:
        """Train to the end (or until a callback, a component or a P0 action stops
        the run); rank 0 returns the run summary and writes run_summary.json.

        A write the disk fails (a checkpoint or a record: full, I/O error) ends the
        attempt: the partial checkpoint removed, the failure and the failed run
        summary recorded with the cause (`_fault`), then `ck.StorageFault` raised,
        which the agent never restarts in place (trainlab.train.supervision.agent).
        The same for a write that fails anywhere else in the loop (a component's or
        a callback's own file, the agent's progress record) with a storage error
        (`ck.storage_error_in`: a full disk, a read-only logs/): it would fail again."""
        try:
            return self._fit()
        except ck.StorageFault as fault:
            self._fault(fault)
            raise
        except Exception as e:
            error = ck.storage_error_in(e, self.job.run_path)
            if error is None:
                raise
            fault = ck.StorageFault(f"writing {self._written(error)} at step {self.step}", error)
            self._fault(fault)
            raise fault from e

    def _fit(self) -> dict[str, Any] | None:
        """The loop of `fit`.

        Each pass: skip what the skip windows say, or get the step's batches, take
        the step, and hand it to the components (trainlab.train.loop.components), which
        decide for themselves. Every step's health signals are read one step late
        (train.metrics): step s-1's after step s is queued, and a step's own when
        a component acts at it, so no checkpoint ever holds a state whose step was
        non-finite."""
        self._start()
        stream: Iterator[tuple[int, list[Batch]]] | None = None
        status: str | None = None
        total = self.cfg.train.total_steps
        while self.step < total and status is None:
            target = self.guard.skip_target(self, self.step)
            if target != self.step:
                status = self.guard.observe(self)
                if status is None:
                    log.info("skipping the batches of steps %d-%d", self.step + 1, target)
                    self.state.progress.step = target
                stream = None
            else:
                if stream is None:
                    stream = self.loader.iter_from(self.step)
                status = self._advance(stream)
            if status == ROLLED_BACK:
                status, stream = None, None
        if status is None:
            status = self.guard.observe(self)
        status = RunStatus.COMPLETED if status in (None, ROLLED_BACK) else status
        for component in self.components:
            component.on_end(self, status)
        return self._finish(status)

    def _advance(self, stream: Iterator[tuple[int, list[Batch]]]) -> str | None:
        """One step from `stream` and its components; a status when the run ends
        (or ROLLED_BACK), else None."""
        t0 = time.perf_counter()
        got_step, micro_batches = next(stream)
        if got_step != self.step:
            raise RuntimeError(f"data stream gave step {got_step}, expected {self.step}")
        t1 = time.perf_counter()
        first = self.step == self.start_step
        compiling = first and compile_on(self.cfg.train.compile, self.env.device.type)
        compiled_before = compile_seconds() if compiling else 0.0
        loss, grad_norm = self.train_step(micro_batches)
        step, last = self.step, self.step == self.cfg.train.total_steps
        step_time = time.perf_counter() - t0
        self.meter.record(data_wait=t1 - t0, step_time=step_time)
        if compiling:  # the blocks compile in this start's first step: said once
            seconds = compile_seconds() - compiled_before
            self.meter.once["compile_time_s"] = seconds
            if self.env.is_main:
                log.info("compiled the transformer blocks in the first step: %.1f s", seconds)
        if step == self.start_step + 1 and self.env.is_main:
            with self.writing("logs/attempts.jsonl"):
                self.records.first_step_done(self.job.session, step)
                resize = self.records.resize_of_latest_attempt(time.time())
                if resize is not None:  # an elastic run continues at another size
                    self.records.add_resize(self.job.session, resize)
            if resize is not None:
                log.info(
                    "resized from %d to %d workers (%s) at step %d: %d step(s) redone, "
                    "%s s from the loss to this step",
                    resize["from_world_size"],
                    resize["to_world_size"],
                    resize["reason"],
                    resize["step"],
                    resize["steps_redone"],
                    resize["seconds"],
                )
                self.callbacks.on_resize(dict(resize))
        for component in self.components:
            component.after_step(self, step)
        asked = self.stop_request()  # rank 0's, carried with this step's signals
        current = launch(self.env, step, loss, grad_norm, step_time, t1 - t0, asked)
        status = self.guard.launch(self, current)  # judges the previous step
        # A stop rank 0 asked for (Ctrl-C, a callback) is read one step late, the same
        # on every rank: the run stops at this step, logging it.
        if status is None and any(c.due(self, step, last) for c in self.components):
            status = self.guard.observe(self)  # this step's own, before anyone acts on it
        if status is not None:
            return status
        self.stop = self.stop_signal
        for component in self.components:
            component.at_step_end(self, step, last)
        if self.stop == HOLD:  # checkpointed for an elastic run's growth: wait for it
            if not last:
                self.growth.hold(self, step)
            self.stop = self.stop_signal = NO_STOP
        if self.stop == NO_STOP:
            return None
        if self.env.is_main and not self.stop_reason:
            self.stop_reason = self.callbacks.stop_reason or "a callback requested a stop"
        return RunStatus.STOPPED

    def request_stop(self, reason: str, save: bool = True) -> None:
        """A component's stop at this step (with a checkpoint unless `save` is False).
        Components run on every rank: call it on all of them, at the same step."""
        from trainlab.train.loop.metrics import STOP

        self.stop = max(self.stop, STOP_AND_SAVE if save else STOP)
        self.stop_reason = self.stop_reason or reason

    def train_step(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over this rank's micro batches; returns (local mean
        loss over its labelled tokens, global gradient norm before clipping) as
        device tensors (read back one step later)."""
        out = train_step_tensors(
            self.state.model,
            self.cfg,
            self.step,
            micro_batches,
            self.env.device,
            loss_factor=math.prod(c.loss_factor(self, self.step + 1) for c in self.components),
        )
        self.state.progress.step += 1
        return out

    def evaluate(self) -> dict[str, float]:
        """Validation loss per source on its held-out split, and "all" (token-weighted)."""
        n, sources = self.cfg.train.eval_batches, self.job.sources
        sums = torch.zeros(2 * len(sources), dtype=torch.float64, device=self.env.device)
        m = self.state.model
        for part in m.parts:
            part.eval()
        with (
            torch.no_grad(),
            loss_context(m),
            autocast_context(self.cfg.train.precision, self.env.device),
        ):
            for i, source in enumerate(sources):
                batches = [
                    to_tensors(b, self.env.device)
                    for b in self.loader.validation_batches(source, n)
                ]
                for total, count in self._eval_losses(batches):
                    sums[2 * i] += total.double()
                    sums[2 * i + 1] += count.double()
        reshard(m.parts)
        for part in m.parts:
            part.train()
        sums = self.env.replica_sum(sums)
        out = {
            s: (sums[2 * i] / sums[2 * i + 1]).item()
            for i, s in enumerate(sources)
            if sums[2 * i + 1] > 0
        }
        if sums[1::2].sum() > 0:
            out["all"] = (sums[0::2].sum() / sums[1::2].sum()).item()
        return out

    def _eval_losses(
        self, batches: list[dict[str, torch.Tensor]]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(summed loss, labelled tokens) of each validation pass: one per micro
        batch, or under pipeline parallelism one schedule pass per step's worth of
        rows (the loss is counted on the last stage's ranks only)."""
        m = self.state.model
        if m.pipeline is None:
            for batch in batches:
                total, count = loss_sum_and_count(m.model, batch, self.cfg.train.loss_chunk_tokens)
                yield local_value(total), count
            return
        if not batches:
            return
        rows = concat(batches)
        step_rows = max(1, self.cfg.global_batch_size // self.env.dp_size)
        n_rows = rows["input_ids"].shape[0]
        for start in range(0, n_rows, step_rows):
            part = {k: v[start : start + step_rows] for k, v in rows.items()}
            short = m.pipeline.microbatches - part["input_ids"].shape[0]
            if short > 0:  # pad with rows that count for nothing
                pad = {k: v[:1].expand(short, *v.shape[1:]).clone() for k, v in part.items()}
                pad["labels"].fill_(IGNORE_INDEX)
                part = concat([part, pad])
            total = m.pipeline.run(part, 1.0, backward=False, chunk=self.cfg.train.loss_chunk_tokens)
            count = (part["labels"] != IGNORE_INDEX).sum()
            yield (total if total is not None else torch.zeros((), device=count.device)), count

    # ----------------------------------------------------------------- around the loop

    def _start(self) -> None:
        """Restore the newest valid checkpoint, record the attempt, start the components."""
        if self.env.is_main:
            # room for the records of the run's end, should the disk fill (`_fault`)
            self.records.reserve_room()
            self.checkpointer.validation_batch = self._validation_batch()
            self.checkpoints = ckpts.catalog(self.job.location).committed()
            if self.job.elastic:  # a new worker group: no growth asked of the old one holds
                self.records.cancel_growth()
        self.last_checkpoint = self.checkpointer.restore()
        self.start_step = self.step
        self._announce_start(self.start_step)
        for component in self.components:
            component.on_start(self)
        self.meter.reset()

    def _validation_batch(self) -> Batch:
        """The fixed batch checkpoint validation runs a forward on."""
        for source in self.job.sources:
            batches = self.loader.validation_batches(source, 1)
            if batches:
                return {k: v[:2] for k, v in batches[0].items()}
        return fallback_batch(self.cfg.model, self.cfg.data.seq_len, self.cfg.train.seed)

    def _announce_start(self, start: int) -> None:
        if not self.env.is_main:
            return
        layout = layout_of(self.cfg)
        saved = (self.last_checkpoint.meta.get("layout") if self.last_checkpoint else None) or None
        with self.writing("logs/attempts.jsonl"):
            self.records.attempt_started(
                self.job.session,
                start,
                self.env.world_size,
                layout,
                resharded_from=saved if saved and saved != layout else None,
            )
        self.restarts = self.records.restarts()
        log.info(
            "%s from step %d of %d (%d worker%s, %s, restarts so far: %d)",
            "resuming" if start else "starting",
            start,
            self.cfg.train.total_steps,
            self.env.world_size,
            "s" if self.env.world_size > 1 else "",
            self.cfg.parallel.strategy,
            self.restarts,
        )
        self.callbacks.on_run_start(
            RunContext(
                cfg=self.cfg,
                plan=self.job.plan,
                run_dir=self.job.run_dir,
                config_hash=self.job.config_hash,
                dataset_fingerprint=self.job.dataset_fingerprint,
                manifest_path=self.job.manifest_path,
                start_step=start,
                restarts=self.restarts,
                ray_job_id=self.job.ray_job_id,
            )
        )

    def stop_request(self) -> int:
        """Rank 0's request (NO_STOP on other ranks): HOLD when an elastic run asks
        for a checkpoint to grow at (trainlab.train.loop.growth); a callback's stop
        saves a checkpoint; a Ctrl-C's (INTERRUPT_REASON) when the run has none yet
        (else a resume would start over from step 0), or when the newest state on
        disk is at least train.checkpoint.on_interrupt_min_age_s old; else the run
        resumes from its newest valid checkpoint, and the steps after it are said to
        be dropped."""
        if not (self.env.is_main and self.callbacks.stop_requested):
            return HOLD if self.growth.ask(self) else NO_STOP
        if self.callbacks.stop_reason != INTERRUPT_REASON:
            return STOP_AND_SAVE
        if self.last_checkpoint is None and self.step > self.start_step:
            return STOP_AND_SAVE
        age = time.time() - self.saver.saved_at
        return STOP_AND_SAVE if age >= self.cfg.train.checkpoint.on_interrupt_min_age_s else STOP

    def weights_sha256(self) -> str | None:
        """Hash of the full model state dict on rank 0 (a collective under FSDP)."""
        return self.state.model.weights_digest()

    def peak_memory(self) -> int:
        """The largest peak memory of any rank (a collective)."""
        mine = torch.tensor([peak_memory_bytes(self.env.device)], dtype=torch.float64)
        return int(self.env.all_reduce_max(mine.to(self.env.device))[0].item())

    def _finish(self, status: str) -> dict[str, Any] | None:
        digest = self.weights_sha256()
        peak = self.peak_memory()
        if not self.env.is_main:
            return None
        self.records.release_room()
        planned = planned_memory_bytes(self.job.plan)
        gap = memory_gap(planned, peak)
        if gap and self.env.device.type == "cuda" and abs(peak / planned - 1) > 0.10:
            log.warning("peak device memory differs from the plan by more than 10%%: %s", gap)
        elif gap:
            log.info("peak memory per device: %s", gap)
        summary = run_summary(
            self.job,
            status,
            step=self.stopped_at if status == RunStatus.STOPPED_BY_ALERT else self.step,
            restarts=self.restarts,
            last_checkpoint=self.last_checkpoint,
            best_checkpoint=ckpts.best(self.checkpoints),
            final_loss=self.last_loss,
            val_losses=self.state.progress.val_losses,
            weights_sha256=digest,
            start_step=self.start_step,
            throughput=self.meter.steady_throughput(),
            stop_reason=self.stop_reason or None,
            peak_memory_bytes=peak,
        )
        summary["rollbacks"] = list(self.checkpointer.rollbacks)
        # val_loss is the latest evaluation; best_val_loss the lowest of the run's:
        # this start's and those its kept checkpoints hold (keep_best keeps the lowest).
        lowest = [v for v in (self.evaluator.best, summary.get("best_val_loss")) if v is not None]
        summary["best_val_loss"] = min(lowest) if lowest else None
        saved = self.last_checkpoint is not None and self.last_checkpoint.step == self.step
        # The state in memory is past the anomaly, or a Ctrl-C stopped without saving.
        if status == RunStatus.STOPPED_BY_ALERT or (status == RunStatus.STOPPED and not saved):
            resume = ckpts.catalog(self.job.location).find_resume(require_valid=True)
            summary["resume_step"] = resume.step if resume else 0
            if self.stop_reason == INTERRUPT_REASON and self.step > summary["resume_step"]:
                # An early Ctrl-C: what the run keeps and what a resume redoes.
                summary["dropped_steps"] = [summary["resume_step"] + 1, self.step]
                log.warning(
                    "interrupt at step %d: no checkpoint there (the newest state on disk was "
                    "younger than train.checkpoint.on_interrupt_min_age_s = %g s); kept: "
                    "step %d, dropped: steps %d-%d (a resume redoes them)",
                    self.step,
                    self.cfg.train.checkpoint.on_interrupt_min_age_s,
                    summary["resume_step"],
                    *summary["dropped_steps"],
                )
        with self.writing(SUMMARY):
            self.records.write_summary(summary)
        self.callbacks.on_run_end(summary)
        return summary

    # ----------------------------------------------------------------- faults

    @contextlib.contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """A record write: an OSError in it is a `ck.StorageFault` (`what` names it)."""
        try:
            yield
        except OSError as e:
            raise ck.StorageFault(f"writing {what} at step {self.step}", e) from e

    def _written(self, error: OSError) -> str:
        """What a failed write wrote: its file, relative to the run when inside it."""
        if not error.filename:
            return "the run's files"
        name = str(error.filename)
        with contextlib.suppress(ValueError):
            return str(Path(name).resolve().relative_to(self.job.run_path.resolve()))
        return name

    def fault_cause(self, fault: ck.StorageFault) -> str:
        """`no space left on device while saving step 20; newest valid checkpoint
        step 10`: what failed, and where a resume would start."""
        newest = ckpts.catalog(self.job.location).find_resume(
            require_valid=self.cfg.train.checkpoint.validate
        )
        where = "no valid checkpoint yet (a resume starts from step 0)"
        if newest is not None:
            where = f"newest valid checkpoint step {newest.step}"
        return f"{ck.fault_text(fault.error)} while {fault.what}; {where}"

    def _fault(self, fault: ck.StorageFault) -> None:
        """End the attempt on a storage fault: every rank removes the partial
        checkpoint and records its failure (kind "storage"); rank 0 frees the
        room it held for this (logs/.reserve), writes the failed run summary with
        the cause and ends the run's records (`on_run_end`: MLflow FAILED). Writes
        that fail again are logged in one line each, never raised over the fault.
        `fault.cause` gets the cause."""
        step = fault.step if fault.step is not None else self.step
        self.checkpointer.writer.abandon()  # a save still in flight ends before the cleanup
        if fault.step is not None:
            self.checkpointer.writer.discard(fault.step)
        if self.env.is_main:
            ckpts.clean_staging(self.job.checkpoint_root)
            self.records.release_room()  # the records below fit on a full disk
        cause = self.fault_cause(fault)
        fault.cause, fault.args = cause, (cause,)
        log.error("the run's storage failed: %s", cause)
        failure = Failure(
            self.job.session, f"storage-{self.job.session}", self.env.rank, step, cause, "storage"
        )
        try:
            self.records.add_failures(failure)
        except OSError as e:
            log.error("could not record the failure in logs/failures.jsonl: %s", e)
        if not self.env.is_main:
            return
        summary = failed_summary(self.job, cause)
        summary["rollbacks"] = list(self.checkpointer.rollbacks)
        try:
            self.records.write_summary(summary)
        except OSError as e:
            log.error("could not write %s: %s", SUMMARY, e)
        self.callbacks.on_run_end(summary)
